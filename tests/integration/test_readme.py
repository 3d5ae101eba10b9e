"""README.md and docs/ run as written: every ```bash block, in order, in a fresh folder that looks like a clone.

The README's blocks come first, then each docs page's in the order the README first links it
(`tests/doc_blocks.py`). Each block is one bash script (`set -eo pipefail`) run in the same temporary folder, so
later blocks find what earlier ones wrote (the checkpoint that generation and export read, for instance). To keep
the run short every `train.py`, `torchpre.generate` and `torchpre.convert` command gets SHRINK appended (a smaller
model on shorter sequences; step counts, and so checkpoint names, stay as written); `torchrun` runs with
`--standalone` so it never collides with another job's port. A block is skipped when its document marks it with
`<!-- readme-test: skip (reason) -->` on the line before it (GPUs, Slurm, several machines), and the README's
"Quick start" blocks are skipped by name: `.ci/run` runs them. A skipped block's command lines are still checked:
every flag it passes to torchrun or to a torchpre entry point must be one that entry point's `--help` lists
(`tests/unit/test_docs.py`, for every block). A ```python block must be marked
`<!-- readme-test: quoted from PATH -->`, and each of its lines must be a line of PATH, a runnable example that the
document quotes.

    python -m pytest -q -p no:cacheprovider tests/integration/test_readme.py            # CI's sample
    python -m pytest -q -p no:cacheprovider -m readme tests/integration/test_readme.py  # every block
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.doc_blocks import REPO, Block, all_blocks, shell_blocks

# What a clone holds that the README's commands use.
CLONE = ["train.py", "train_configs", "torchpre", "examples", "assets", "scripts", "bench", "multinode.slurm"]
SKIPPED_README_SECTIONS = ("Quick start #",)  # run by .ci/run
SHRINK = ["--model.flavor", "tiny", "--training.seq_len", "32"]
# Blocks that need more than SHRINK gives, or a test-only change to run unattended.
LAYOUTS_BLOCK = "docs/parallelism.md: DP x TP x PP on one DeviceMesh #1"
PREEMPTION_BLOCK = "docs/fault-tolerance.md: Fault tolerance #2"
EXTENSION_BLOCK = "docs/context-parallel.md: Extend the context of a trained model #2"
DEEPSEEK_V3_BLOCKS = [
    "docs/deepseek-v3.md: Train the debug model #1", "docs/deepseek-v3.md: Train the debug model #2",
    "docs/deepseek-v3.md: Import and export a Hugging Face folder #1",
]  # fmt: skip
# The released stand-ins' models come from their config.json.
RELEASED_BLOCK = "docs/checkpoints.md: Start from a released model #1"
BLOCK_ARGS = {
    # The ZBV schedule puts 2 stages on each of 2 ranks: 4 layers at least (tiny has 2).
    LAYOUTS_BLOCK: ["--model.flavor", "debugmodel", "--training.steps", "10"],
    # Long enough that the SIGTERM arrives mid-run, and a record to wait for instead of a minute.
    PREEMPTION_BLOCK: ["--training.steps", "100000", "--metrics.log_freq", "1"],
    # The context extension's second stage keeps its longer sequences.
    EXTENSION_BLOCK: ["--training.seq_len", "64"],
    # deepseek_v3 has no tiny flavor: its debug model (446,592 parameters) is as small.
    **{block: ["--model.flavor", "debugmodel"] for block in DEEPSEEK_V3_BLOCKS},
    RELEASED_BLOCK: ["--model.flavor", "from_hf"],
}
BLOCK_TEXT = {PREEMPTION_BLOCK: ("sleep 60", "until [ -s outputs/preempt/metrics.jsonl ]; do sleep 0.2; done")}
# CI's sample: the README's tour up to the planner (dp, tp, pp, ZeRO-3, a checkpoint resumed under another
# layout, export and generation from it), overrides, and the bad-input exit codes.
SAMPLE = [
    "Tour #1", "Tour #2", "Tour #3", "Tour #4", "Tour #5", "Tour #6",
    "docs/configuration.md: Configuration #1",
    "docs/errors.md: Errors and exit codes #1",
]
BLOCK_TIMEOUT_S = 600

@pytest.fixture
def clone(tmp_path: Path) -> Path:
    return make_clone(tmp_path)


def make_clone(folder: Path) -> Path:
    """Makes `folder` look like a fresh clone (the repository's files linked in), with `python` and
    `torchrun` on PATH wrapped to append each block's shortening arguments (see the module docstring)."""
    for name in CLONE:
        (folder / name).symlink_to(REPO / name)
    bin_dir = folder / ".bin"
    bin_dir.mkdir()
    entry_points = '*" train.py "*|*" torchpre.generate "*|*" torchpre.convert "*'
    for name, launcher in (("python", ""), ("torchrun", "-m torch.distributed.run --standalone")):
        wrapper = bin_dir / name
        wrapper.write_text(
            "#!/bin/bash\n"
            f'case " $* " in {entry_points}) exec {sys.executable} {launcher} "$@" $README_TEST_ARGS ;; esac\n'
            f'exec {sys.executable} {launcher} "$@"\n'
        )
        wrapper.chmod(0o755)
    return folder


def run_blocks(blocks: list[Block], folder: Path, verbose: bool = False) -> list[tuple[str, float]]:
    """Runs the blocks in order in `folder`; fails naming the first one that breaks. Returns each one's time."""
    env = {
        **os.environ,
        "PATH": f"{folder / '.bin'}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(REPO),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "WANDB_SILENT": "true",
    }
    timings = []
    for block in blocks:
        script = block.text
        if block.name in BLOCK_TEXT:
            script = script.replace(*BLOCK_TEXT[block.name])
        args = " ".join([*SHRINK, *BLOCK_ARGS.get(block.name, [])])
        start = time.perf_counter()
        try:
            result = subprocess.run(
                ["bash", "-e", "-o", "pipefail", "-c", script],
                cwd=folder,
                env={**env, "README_TEST_ARGS": args},
                capture_output=True,
                text=True,
                timeout=BLOCK_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"block '{block.name}' ({block.where}) ran past {BLOCK_TIMEOUT_S} s")
        if result.returncode != 0:
            pytest.fail(
                f"block '{block.name}' ({block.where}) failed with exit code "
                f"{result.returncode}:\n{script}\n--- output (tail) ---\n"
                f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
            )
        timings.append((block.name, time.perf_counter() - start))
        if verbose:
            print(f"{timings[-1][1]:7.1f} s  {block.name}", flush=True)
    return timings


def runnable(block: Block) -> bool:
    return not block.skip and not block.name.startswith(SKIPPED_README_SECTIONS)


def test_block_names_and_markers_are_well_formed():
    """The sample and the per-block settings name real blocks; only marked blocks and Quick start are skipped;
    every python block is quoted from a file that exists."""
    names = {b.name for b in shell_blocks()}
    assert set(SAMPLE) <= names and set(BLOCK_ARGS) <= names and set(BLOCK_TEXT) <= names
    skipped = {b.name for b in shell_blocks() if not runnable(b)}
    assert skipped == {
        "Quick start #1", "Quick start #2", "docs/fault-tolerance.md: Elastic training #1",
        "docs/fault-tolerance.md: Elastic training #2", "docs/multinode.md: Two nodes by hand #1",
        "docs/multinode.md: Slurm #1", "docs/testing.md: Testing #1", "docs/multinode.md: The rendezvous address #1",
        "docs/multinode.md: Tested under a real Slurm #1", "docs/checkpoints.md: Start from a released model #2",
        "docs/evaluation.md: Against lm-evaluation-harness itself #1",  # needs the lm-eval extra (-m lm_eval)
    }, "a block is skipped that should run (or a new skip marker: add it here with its reason)"
    for block in all_blocks():
        if block.language == "python":
            assert block.quoted_from, f"python block '{block.name}' must be quoted from a runnable example"


@pytest.mark.parametrize("block", [b for b in all_blocks() if b.quoted_from], ids=lambda b: b.name)
def test_quoted_python_is_the_example_file(block):
    """Each line of the quoted block is a line of the example, so the document shows code that runs."""
    source = {line.strip() for line in (REPO / block.quoted_from).read_text(encoding="utf-8").splitlines()}
    missing = [line for line in block.text.splitlines() if line.strip() and line.strip() not in source]
    assert not missing, f"block '{block.name}' ({block.where}) has lines not in {block.quoted_from}: {missing}"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_readme_sample_runs(clone):
    blocks = {b.name: b for b in shell_blocks()}
    run_blocks([blocks[name] for name in SAMPLE], clone)


@pytest.mark.readme
@pytest.mark.timeout(3600)
def test_every_readme_block_runs_in_order(clone):
    """Every block of README.md and docs/ but the skipped ones: deselected unless `-m readme` (tests/conftest.py)."""
    timings = run_blocks([b for b in shell_blocks() if runnable(b)], clone)
    print("\n".join(f"{seconds:7.1f} s  {name}" for name, seconds in timings))
