"""The README stays a front door and docs/ stays whole: a length bound, no broken link or anchor, no page nothing
links to, a configuration reference that is what the code says, and every flag a shell block passes to torchrun or
to a torchpre entry point one that entry point accepts (the blocks themselves run in
tests/integration/test_readme.py)."""

import functools
import re
import subprocess
import sys

import pytest

from tests.doc_blocks import DOCS, README, REPO, anchors, commands, documents, links, shell_blocks

README_MAX_LINES = 250


def test_the_readme_is_short():
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move the depth into a docs/ page and link it"


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for page in documents():
        for target in links(page):
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(REPO)} -> {target}"
            if not resolved.exists():
                broken.append(f"{where}: no such file")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{where}: no heading with that anchor in {resolved.relative_to(REPO)}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_no_docs_file_is_an_orphan():
    """Every file under docs/ is reached from the README by links (pages through pages, images from a page)."""
    reached = set(documents())
    for page in documents():
        reached |= {(page.parent / t.partition("#")[0]).resolve() for t in links(page) if t.partition("#")[0]}
    orphans = [p.relative_to(REPO) for p in sorted(DOCS.rglob("*")) if p.is_file() and p.resolve() not in reached]
    assert not orphans, f"nothing links to {orphans}: link them from the README's table of contents or a page"


def test_the_configuration_reference_is_current():
    result = subprocess.run([sys.executable, "scripts/config_reference.py", "--check"], cwd=REPO, capture_output=True,
                            text=True)  # fmt: skip
    assert result.returncode == 0, result.stderr


@functools.cache
def accepted_flags(entry_point: str) -> frozenset[str]:
    """The flags an entry point's `--help` names; entry points that take the job's options (convert: "any
    --section.key", plan: "every option of python -m torchpre.train") also accept every `--section.key` that
    train.py's help lists."""
    if entry_point == "torchrun":
        argv = [sys.executable, "-m", "torch.distributed.run", "--help"]
    elif entry_point == "train.py":
        argv = [sys.executable, "train.py", "--help"]
    else:
        argv = [sys.executable, "-m", entry_point, "--help"]
    result = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{' '.join(argv[1:])} failed:\n{result.stderr[-2000:]}"
    flags = set(re.findall(r"(?<![\w.-])(--[\w][\w.-]*)", result.stdout))
    takes_job_options = any(s in result.stdout for s in ("--section.key", "every option of python -m torchpre.train"))
    if entry_point not in ("torchrun", "train.py") and takes_job_options:
        flags |= {flag for flag in accepted_flags("train.py") if "." in flag}
    return frozenset(flags)


def test_every_flag_in_a_shell_block_exists():
    """Run or skipped (GPUs, Slurm, several machines), a block's command lines name only flags their entry point
    accepts, so a renamed or misspelt flag in the docs fails here, not on a user's cluster."""
    unknown = [
        f"{block.name} ({block.where}): {command.entry_point} has no {flag}"
        for block in shell_blocks()
        for command in commands(block.text)
        for flag in command.flags
        if flag not in accepted_flags(command.entry_point)
    ]
    assert not unknown, "\n".join(unknown)


@pytest.mark.parametrize(
    "script, expected",
    [
        ("torchrun --nproc_per_node=2 --max-restarts 3 train.py --a.b 1 \\\n    --c.d", [
            ("torchrun", ("--nproc_per_node", "--max-restarts")), ("train.py", ("--a.b", "--c.d"))]),
        ("WANDB_MODE=offline python -m torchpre.plot x -o y.png && python -m torchpre.plan --gpus=8  # --not.this", [
            ("torchpre.plot", ()), ("torchpre.plan", ("--gpus",))]),
        ("ls outputs | tail -n 1; python examples/make_sample_data.py web --x", []),
        ("sbatch --nodes 4 multinode.slurm my_job.toml --parallelism.tensor_parallel_degree 8", [
            ("train.py", ("--parallelism.tensor_parallel_degree",))]),
    ],
)  # fmt: skip
def test_commands_are_read_off_a_block(script, expected):
    assert [(c.entry_point, c.flags) for c in commands(script)] == expected
