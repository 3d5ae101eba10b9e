"""Bytes per parameter of the training state under ZeRO stages 0 and 1, measured against the theory.

Runs the debug model for 2 steps per configuration (fp32 and bf16, dp 1/2/4) and prints a table:
parameter + gradient bytes (known from the dtypes) plus the optimizer state that metrics.jsonl
reports (max over ranks), per model parameter.   Usage: python bench/zero_memory.py
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NUM_PARAMS = 5_770_496  # the debug model with the shipped 2048-token tokenizer
COMMON = ["--model.flavor", "debugmodel", "--training.seq_len", "32", "--training.steps", "2",
          "--training.global_batch_size", "8", "--metrics.log_freq", "1"]


def optimizer_state_bytes(dp: int, zero_stage: int, dtype: str) -> int:
    with tempfile.TemporaryDirectory() as folder:
        launcher = [sys.executable] if dp == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={dp}"]
        args = [*COMMON, "--training.local_batch_size", str(8 // dp), "--optimizer.zero_stage", str(zero_stage),
                "--training.mixed_precision_param", dtype, "--job.dump_folder", folder]
        subprocess.run([*launcher, "train.py", *args], cwd=REPO, check=True, capture_output=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
        last = (Path(folder) / "metrics.jsonl").read_text().splitlines()[-1]
        return json.loads(last)["optimizer_state_bytes"]


def theory(dp: int, zero_stage: int, dtype: str) -> float:
    shard = dp if zero_stage == 1 else 1
    if dtype == "float32":  # param 4 + grad 4 + Adam moments 8 (the master is the parameter itself)
        return 8 + 8 / shard
    return 6 + 12 / shard  # bf16 param 2 + fp32 grad 4 + fp32 master and moments 12


def main() -> None:
    print("| dtype | dp | zero_stage | measured bytes/param | theory |")
    print("|---|---|---|---|---|")
    for dtype in ("float32", "bfloat16"):
        weights_and_grads = (4 if dtype == "float32" else 2) + 4
        for dp in (1, 2, 4):
            for zero_stage in (0, 1):
                if dp == 1 and zero_stage == 1:
                    continue
                measured = weights_and_grads + optimizer_state_bytes(dp, zero_stage, dtype) / NUM_PARAMS
                print(f"| {dtype} | {dp} | {zero_stage} | {measured:.2f} | {theory(dp, zero_stage, dtype):.2f} |",
                      flush=True)


if __name__ == "__main__":
    main()
