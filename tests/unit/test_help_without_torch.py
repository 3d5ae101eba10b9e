"""The front door answers without torch: `train.py --help` and a mistyped flag need only the config parser.

Each runs in a fresh interpreter where `import torch` fails (a stand-in package first on the path), so a module
that loads torch before the command line is parsed fails these tests instead of slowing every `--help` by seconds
and breaking it outright in an environment without torch.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import REPO


@pytest.fixture(scope="module")
def env_without_torch(tmp_path_factory) -> dict[str, str]:
    shadow = tmp_path_factory.mktemp("no_torch")
    (shadow / "torch").mkdir()
    (shadow / "torch" / "__init__.py").write_text("raise ImportError('torch is hidden by this test')\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow), str(REPO)])}


@pytest.mark.parametrize("entry", [["train.py"], ["-m", "torchpre.train"]], ids=["train.py", "torchpre.train"])
def test_help_lists_the_options_without_torch(env_without_torch, entry):
    result = run([*entry, "--help"], env_without_torch)
    assert result.returncode == 0, result.stderr
    assert "--training.steps" in result.stdout and "--optimizer.name" in result.stdout


def test_a_mistyped_flag_gets_its_suggestion_without_torch(env_without_torch):
    result = run(["train.py", "--training.stepz", "3"], env_without_torch)
    assert result.returncode == 2, result.stderr
    assert "training.steps" in result.stderr and "torch is hidden" not in result.stderr


def run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=Path(REPO), env=env, capture_output=True, text=True, timeout=60)


def test_the_config_package_imports_without_torch(env_without_torch):
    """Every section, the parser and the value checks: what --help, the planner's flags and any tool that reads a
    job's TOML need, without loading torch (the optimizer registry's checks, which need it, run at start-up)."""
    code = "import torchpre.config.job_config, torchpre.config.parser, torchpre.config.validate; print('ok')"
    result = run(["-c", code], env_without_torch)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
