"""Runs train.py in real processes (torchrun for several, or forks of a warm interpreter) and reads back
what it wrote; spawns gloo workers for in-process multi-rank tests."""

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

REPO = Path(__file__).resolve().parents[1]

# The debug model (6 layers, so up to 4 pipeline stages) on short sequences: the layout tests' model.
DEBUG = [
    "--model.flavor", "debugmodel",
    "--training.seq_len", "32",
    "--lr_scheduler.warmup_steps", "2",
    "--metrics.log_freq", "1",
]

# A model small enough that a 2-core machine trains it in seconds, big enough to exercise GQA.
TINY = [
    "--model.flavor", "tiny",
    "--training.seq_len", "32",
    "--training.local_batch_size", "4",
    "--lr_scheduler.warmup_steps", "2",
    "--metrics.log_freq", "1",
]


def run_train(
    args: list[str],
    nproc: int,
    dump_folder: Path,
    timeout: float = 240,
    script: str = "train.py",
    module: str | None = None,
) -> subprocess.CompletedProcess:
    """`python train.py` for one process, torchrun on a free port for several; never hangs past `timeout`.
    With `module`, `python -m module` (`torchrun -m module`) instead of the script."""
    target = ["-m", module] if module else [script]
    if nproc == 1:
        command = [sys.executable, *target]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *target]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [*command, "--job.dump_folder", str(dump_folder), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def train_and_read_metrics(
    args: list[str], nproc: int, dump_folder: Path, script: str = "train.py", module: str | None = None
) -> list[dict]:
    """Trains and returns the records of metrics.jsonl; fails the test with the job's output if it fails."""
    result = run_train(args, nproc, dump_folder, script=script, module=module)
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


def spawn(fn: Callable[[DeviceMesh], None], world_size: int, store_path: Path, timeout_s: float = 120) -> None:
    """Runs `fn(mesh)` on `world_size` gloo processes; a worker's exception or a hang fails.

    The processes rendezvous through a FileStore, as PyTorch's own distributed tests do: no port
    to race for, and no store server living in rank 0 that may exit while rank 1 tears down.
    """
    context = mp.start_processes(
        _worker, args=(fn, world_size, str(store_path)), nprocs=world_size, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(deadline - time.monotonic(), 0)):
        if time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{fn.__name__} did not finish within {timeout_s} s on {world_size} processes")


def _worker(rank: int, fn: Callable[[DeviceMesh], None], world_size: int, store_path: str) -> None:
    torch.set_num_threads(1)  # two processes on two cores
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    fn(init_device_mesh("cpu", (world_size,)))
    dist.barrier()  # without it gloo intermittently aborts at exit (see cpu-notes)
    dist.destroy_process_group()


@dataclasses.dataclass(frozen=True)
class ForkResult:
    returncode: int
    stdout: str
    stderr: str
    seconds: float


class ForkServer:
    """Talks to tests/fork_server.py, which runs each request as fresh processes forked from one warm
    interpreter: no Python and torch start-up per launch. `startup_s` (that start-up, paid once) is added to
    each result's time; a request running past `timeout_s` fails the test."""

    def __init__(self, log: Path, timeout_s: float = 60):
        start = time.monotonic()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.timeout_s = timeout_s
        self._log = log.open("w")
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tests.fork_server"],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        assert json.loads(self._process.stdout.readline() or "{}").get("ready"), log.read_text()
        self.startup_s = time.monotonic() - start

    def run(self, entry: str, argv: list[str], env: dict[str, str | None] | None = None, nproc: int = 1) -> ForkResult:
        """`entry` with `argv`, as `nproc` ranks of one job (as torchrun would start them) when nproc > 1."""
        request = {"entry": entry, "argv": argv, "env": env or {}, "timeout_s": self.timeout_s, "nproc": nproc}
        self._process.stdin.write(json.dumps(request) + "\n")
        self._process.stdin.flush()
        reply = json.loads(self._process.stdout.readline())
        assert not reply["timed_out"], f"{entry} {argv} ran past {self.timeout_s} s:\n{reply['stderr'][-3000:]}"
        return ForkResult(reply["returncode"], reply["stdout"], reply["stderr"], reply["seconds"] + self.startup_s)

    def close(self) -> None:
        self._process.stdin.close()
        self._process.wait(timeout=30)
        self._log.close()
