"""The README's Quick start and CI cannot drift apart: `.ci/run` runs the README's two commands as written."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def section(markdown: str, heading: str) -> str:
    """The text under a `## heading`, up to the next heading of that level."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", markdown, flags=re.S | re.M)
    assert match, f"README.md has no '## {heading}' section"
    return match.group(1)


def shell_commands(text: str) -> list[str]:
    """The command lines of a shell script or of a markdown text's ```bash blocks, continuation lines joined,
    comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", "", text)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def quick_start_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", section((REPO / "README.md").read_text(), "Quick start"), flags=re.S)
    return [command for block in blocks for command in shell_commands(block)]


def test_the_quick_start_is_one_install_and_train_command_and_one_install_and_test_command() -> None:
    install_and_train, install_and_test = quick_start_commands()
    assert install_and_train.startswith("pip install -e . && torchrun ")
    assert "train.py --job.config_file train_configs/debug_model.toml" in install_and_train
    assert re.match(r'pip install -e "\.\[[a-z0-9,]+\]" && python -m pytest ', install_and_test)


def test_ci_runs_the_quick_start_commands_as_written() -> None:
    """Training may get extra flags appended (fewer steps, a scratch dump folder); the test line is verbatim."""
    ci = shell_commands((REPO / ".ci" / "run").read_text())
    install_and_train, install_and_test = quick_start_commands()
    assert any(line.startswith(install_and_train + " --") for line in ci), (install_and_train, ci)
    assert install_and_test in ci, (install_and_test, ci)


def test_ci_installs_into_a_new_virtual_environment() -> None:
    ci = shell_commands((REPO / ".ci" / "run").read_text())
    creates = next(i for i, line in enumerate(ci) if line.startswith("python3 -m venv "))
    activates = next(i for i, line in enumerate(ci) if line.startswith(". ") and "/bin/activate" in line)
    first_install = next(i for i, line in enumerate(ci) if line.startswith("pip install"))
    assert creates < activates < first_install
    assert not any("--system-site-packages" in line for line in ci)
    assert "export TORCHPRE_REQUIRE_EXTRAS=1" in ci


def test_ci_installs_the_versions_the_committed_outputs_were_made_with() -> None:
    """A fresh install gets the newest releases; CI pins the ones docs/hf-models.md was generated with (a new
    transformers adds rows) and the bitwise tests were run against, through PIP_CONSTRAINT, not the README."""
    ci = shell_commands((REPO / ".ci" / "run").read_text())
    constrains = next(i for i, line in enumerate(ci) if line.startswith("export PIP_CONSTRAINT="))
    assert constrains < next(i for i, line in enumerate(ci) if line.startswith("pip install"))
    assert ci[constrains] == 'export PIP_CONSTRAINT="$PWD/.ci/constraints.txt"'
    pins = dict(line.split("==") for line in shell_commands((REPO / ".ci" / "constraints.txt").read_text()))
    assert set(pins) == {"torch", "torchao", "transformers"}
    table_version = re.search(r"\(([^ ]+) here\)", (REPO / "docs" / "hf-models.md").read_text()).group(1)
    assert pins["transformers"] == table_version, "regenerate docs/hf-models.md with the pinned transformers"
