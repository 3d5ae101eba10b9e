"""What the benchmarks share: running train.py in fresh processes, steady-state numbers from its
metrics.jsonl, and printing Markdown tables."""

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_torchpre(args: Sequence[str], nproc: int = 1, script: str = "train.py") -> list[dict]:
    """Runs `script` (train.py by default) with one thread per process, `python` for one process and
    torchrun for several, and returns the records of its metrics.jsonl. Fails with the job's output."""
    launcher = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"
    ]
    with tempfile.TemporaryDirectory() as folder:
        result = subprocess.run(
            [*launcher, script, "--job.dump_folder", folder, *args],
            cwd=REPO,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise RuntimeError(f"{script} {' '.join(args)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
        lines = (Path(folder) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def workload_args(flavor: str, seq_len: int, global_batch: int, steps: int) -> list[str]:
    """train.py's options for a benchmark's model and batch, with a metrics record every step."""
    return [
        "--model.flavor", flavor,
        "--training.seq_len", str(seq_len),
        "--training.global_batch_size", str(global_batch),
        "--training.steps", str(steps),
        "--metrics.log_freq", "1",
    ]  # fmt: skip


def steady(records: list[dict], key: str, warmup: int) -> float:
    """The median of `key` over the records after the first `warmup` steps (compilation, allocator
    and cache warm-up are not what a long run sees)."""
    values = [record[key] for record in records if record["step"] > warmup]
    if not values:
        raise ValueError(f"no steps after the {warmup} warm-up steps; run more steps")
    return statistics.median(values)


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A Markdown table, so the output can be pasted into the README as it is."""
    print(f"\n### {title}\n")
    print("| " + " | ".join(headers) + " |")
    print("|" + "---|" * len(headers))
    for row in rows:
        print("| " + " | ".join(_cell(value) for value in row) + " |", flush=True)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)
