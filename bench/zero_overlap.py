"""Exposed data-parallel gradient communication per step, with and without overlapping it with backward.

Trains the debug model at dp2 with gradient accumulation 4 (global batch 16, local 2) for 20 steps under ZeRO-1,
ZeRO-2 (reduce-scatter every microbatch) and ZeRO-2 with `zero2_accumulate_locally`, each with
`optimizer.overlap_grad_reduce` off and on, and prints the medians over the steps after the first two of
`time/grad_comm_s` (the wait in `reduce_gradients()` after the last backward: what overlap did not hide),
`time/forward_backward_s`, `step_time_s` and the peak memory (`max_memory_bytes`, max over ranks). Buckets of
2 MiB cut the debug model's 22 MiB of gradients into about a dozen, as 25 MiB buckets cut a billion-parameter model's.

    python bench/zero_overlap.py [--steps 20]

On CPU/gloo a reduce-scatter is an all-reduce plus a copy (pytorch/pytorch#118911), and the two processes share
the cores the backward runs on, so "hidden" communication still costs compute time here.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMON = ["--model.flavor", "debugmodel", "--training.seq_len", "32", "--training.global_batch_size", "16",
          "--training.local_batch_size", "2", "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "2",
          "--optimizer.bucket_size_mb", "2"]
CONFIGS = {
    "zero1": ["--optimizer.zero_stage", "1"],
    "zero2": ["--optimizer.zero_stage", "2"],
    "zero2 local": ["--optimizer.zero_stage", "2", "--optimizer.zero2_accumulate_locally"],
}
SKIPPED_STEPS = 2  # warm-up: allocator growth, first-call overheads


def run(args: list[str], steps: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as folder:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        command = [*launcher, "train.py", *COMMON, *args, "--training.steps", str(steps), "--job.dump_folder", folder]
        subprocess.run(command, cwd=REPO, check=True, capture_output=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
        return [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines()]


def median(records: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in records[SKIPPED_STEPS:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    steps = parser.parse_args().steps
    print("| config | overlap | exposed grad comm (ms/step) | forward+backward (ms) | step (ms) | peak memory (MiB) |")
    print("|---|---|---|---|---|---|")
    for name, args in CONFIGS.items():
        for overlap in (False, True):
            records = run([*args, f"--optimizer.overlap_grad_reduce={str(overlap).lower()}"], steps)
            comm, compute = median(records, "time/grad_comm_s"), median(records, "time/forward_backward_s")
            peak = max(r["max_memory_bytes"] for r in records) / 2**20
            print(f"| {name} | {'on' if overlap else 'off'} | {1e3 * comm:.1f} | {1e3 * compute:.0f} | "
                  f"{1e3 * median(records, 'step_time_s'):.0f} | {peak:.0f} |", flush=True)


if __name__ == "__main__":
    main()
