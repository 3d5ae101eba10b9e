"""Runs train.py in real processes (torchrun for several) and reads back what it wrote."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

# A model small enough that a 2-core machine trains it in seconds, big enough to exercise GQA.
TINY = [
    "--model.flavor", "tiny",
    "--training.seq_len", "32",
    "--training.local_batch_size", "4",
    "--lr_scheduler.warmup_steps", "2",
    "--metrics.log_freq", "1",
]


def run_train(
    args: list[str], nproc: int, dump_folder: Path, timeout: float = 240, script: str = "train.py"
) -> subprocess.CompletedProcess:
    """`python train.py` for one process, torchrun on a free port for several; never hangs past `timeout`."""
    if nproc == 1:
        command = [sys.executable, script]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [*command, "--job.dump_folder", str(dump_folder), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def train_and_read_metrics(args: list[str], nproc: int, dump_folder: Path) -> list[dict]:
    """Trains and returns the records of metrics.jsonl; fails the test with the job's output if it fails."""
    result = run_train(args, nproc, dump_folder)
    assert result.returncode == 0, f"training failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    lines = (dump_folder / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def train_and_read_params(args: list[str], nproc: int, dump_folder: Path) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Trains with tests/train_and_dump.py; returns the metrics and the final parameters by name
    (pipeline stages merged; a weight held by two stages must agree)."""
    result = run_train(args, nproc, dump_folder, script="tests/train_and_dump.py")
    assert result.returncode == 0, f"training failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    params: dict[str, torch.Tensor] = {}
    for path in sorted(dump_folder.glob("params_rank*.pt")):
        for name, value in torch.load(path).items():
            if name in params:
                torch.testing.assert_close(value, params[name], rtol=0, atol=0, msg=f"{name} differs between ranks")
            params[name] = value
    records = [json.loads(line) for line in (dump_folder / "metrics.jsonl").read_text().splitlines()]
    return records, params
