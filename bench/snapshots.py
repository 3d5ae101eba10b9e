"""What in-memory snapshots cost and what they save (checkpoint.memory_interval, docs/fault-tolerance.md).

- **Blocked**: at memory_interval 1 each step waits while the state is copied into the host buffer (the write, the
  peer exchange and the publication run in a thread during the next step); train.py logs that wait as
  `snapshot/blocked_s`. Runs with memory_interval 1 and 0 alternate, so that a change in the machine's load hits
  both alike; the share is the blocked time over the step time with snapshots off, and the step-time ratio shows
  what the background thread costs the step besides.
- **Restart**: a torchrun job (--max-restarts 1) whose rank 1 is killed (SIGKILL) after step KILL_AFTER; the time
  from the kill to the restarted job's first new step in metrics.jsonl, resuming from the snapshots (no disk
  checkpoint since the start) and, for the same state, from a disk checkpoint saved every step.

Usage: python -m bench.snapshots [--repeats R] [--quick]
"""

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO, print_table, run_torchpre, steady

MODEL = ["--model.flavor", "debugmodel", "--training.seq_len", "256", "--training.local_batch_size", "4"]
QUICK_MODEL = ["--model.flavor", "tiny", "--training.seq_len", "32", "--training.local_batch_size", "2"]
WARMUP = 2
KILL_AFTER = 6
RESTORED = re.compile(r"restored the state of step (\d+) in ([0-9.]+) s")


def blocked(model: list[str], steps: int, repeats: int, interval: int, folder: Path) -> list[str]:
    """The median over `repeats` pairs of runs on 2 processes, snapshots every `interval` steps and off: step time
    off and on, the blocked time of a snapshot, its share of a step, and the step time's change."""
    common = [*model, "--training.steps", str(steps), "--metrics.log_freq", "1", "--checkpoint.enable",
              "--checkpoint.interval", "1000", "--checkpoint.memory_folder", str(folder)]  # fmt: skip
    on, off = [], []
    for _ in range(repeats):
        on.append(run_torchpre([*common, "--checkpoint.memory_interval", str(interval)], nproc=2))
        off.append(run_torchpre([*common, "--checkpoint.memory_interval", "0"], nproc=2))
    step_on = statistics.median(steady(records[:-1], "step_time_s", WARMUP) for records in on)
    step_off = statistics.median(steady(records[:-1], "step_time_s", WARMUP) for records in off)
    snapshotted = [[record for record in records if "snapshot/blocked_s" in record] for records in on]
    waited = statistics.median(steady(records, "snapshot/blocked_s", WARMUP) for records in snapshotted)
    return [f"{step_off:.3f}", f"{step_on:.3f}", f"{waited:.4f}", f"{100 * waited / step_off:.1f}%",
            f"{100 * (step_on / step_off - 1):+.1f}%"]  # fmt: skip


def restart(model: list[str], source: str, folder: Path) -> tuple[float, float, int]:
    """Seconds from killing rank 1 after step KILL_AFTER to the first new step of the restarted job, resuming from
    `source` ("snapshots" or "disk"); the seconds its restore took (as train.py logs it); the step it resumed."""
    run = folder / source
    saves = (["--checkpoint.interval", "1000", "--checkpoint.memory_interval", "1"] if source == "snapshots"
             else ["--checkpoint.interval", "1", "--checkpoint.memory_interval", "0"])  # fmt: skip
    args = [*model, "--training.steps", str(KILL_AFTER + 4), "--metrics.log_freq", "1", "--checkpoint.enable",
            *saves, "--checkpoint.memory_folder", str(folder / "shm"), "--job.dump_folder", str(run)]  # fmt: skip
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts",
               "1", "train.py", *args]  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / f"{source}.log"
    with log.open("w") as output:
        job = subprocess.Popen(command, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=output,
                               stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        _wait(lambda: len(_steps(run)) > KILL_AFTER, job, log)
        os.kill(_worker(job.pid, rank=1), signal.SIGKILL)
        killed = time.monotonic()
        _wait(lambda: RESTORED.search(log.read_text()) is not None, job, log)
        match = RESTORED.search(log.read_text())
        step, restore_s = int(match[1]), float(match[2])
        _wait(lambda: step + 1 in _steps(run), job, log)
        seconds = time.monotonic() - killed
        job.wait(timeout=300)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    return seconds, restore_s, step


def _steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line)["step"] for line in lines if line.endswith("}")]


def _worker(agent: int, rank: int) -> int:
    """The pid of torchrun's worker with this RANK."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            environ = (stat.parent / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if parent == agent and f"RANK={rank}".encode() in environ:
            return int(stat.parent.name)
    raise RuntimeError(f"no worker of RANK={rank} under {agent}")


def _wait(condition, job: subprocess.Popen, log: Path, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if job.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the job ended or hung:\n{log.read_text()[-3000:]}")
        time.sleep(0.005)


def main(argv: list[str] | None = None) -> dict[str, list]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="steps per run of the blocked-time pairs")
    parser.add_argument("--repeats", type=int, default=3, help="pairs of runs (interval 1, 0); restarts of each kind")
    parser.add_argument("--interval", type=int, default=1, help="checkpoint.memory_interval of the paired runs")
    parser.add_argument("--no-restart", action="store_true", help="the blocked time only")
    parser.add_argument("--quick", action="store_true", help="tiny model, 6 steps, 1 pair, 1 restart each (tests)")
    args = parser.parse_args(argv)
    model = QUICK_MODEL if args.quick else MODEL
    if args.quick:
        args.steps, args.repeats = 6, 1
    name = "tiny" if args.quick else "debug"
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        row = blocked(model, args.steps, args.repeats, args.interval, folder / "shm")
        print_table(
            f"In-memory snapshots at interval {args.interval}, {name} model, dp2 on 2 processes, median of steps "
            f"{WARMUP + 1}-{args.steps - 1} and of {args.repeats} pairs of runs",
            ["step, interval 0 (s)", f"step, interval {args.interval} (s)", "blocked (s)", "blocked share",
             "step time change"],
            [row],
        )  # fmt: skip
        if args.no_restart:
            return {"blocked": row}
        times: dict[str, list[tuple[float, float, int]]] = {"snapshots": [], "disk": []}
        for index in range(args.repeats):
            for source in times:
                times[source].append(restart(model, source, folder / f"{source}-{index}"))
        print_table(
            f"Kill to first new step, {name} model, dp2, rank 1 killed after step {KILL_AFTER}, median of "
            f"{args.repeats}",
            ["resumed from", "kill to first new step (s)", "restore (s)", "resumed step"],
            [[source, f"{statistics.median(run[0] for run in runs):.1f}",
              f"{statistics.median(run[1] for run in runs):.2f}", ", ".join(str(run[2]) for run in runs)]
             for source, runs in times.items()],
        )  # fmt: skip
    return {"blocked": row, **times}


if __name__ == "__main__":
    main()
