"""Peak memory per rank under activation checkpointing (AC) and ZeRO stages, measured in one invocation.

Trains every combination of AC mode (none, full, selective every 2nd block, selective per op) and
ZeRO stage 0 or 1, and AC none and full under ZeRO 2 and 3, at dp=2 (two processes under torchrun) for --steps
steps, through bench/memory_worker.py (the real Trainer, built as train.py builds it), and prints for the last step,
as the max over ranks:

- peak RSS: torchpre's `max_memory_bytes` on CPU. It includes the Python/torch baseline (hundreds of
  MiB) and the C allocator's cache, which dilutes every saving; hence the next columns.
- tensor peak: the peak of live tensor bytes during the step, the CPU counterpart of CUDA's
  `max_memory_allocated` (memory_worker.py explains how it is counted).
- activations: the bytes the forward leaves alive for backward, which AC trades for recompute.
- optimizer state: torchpre's `optimizer_state_bytes`, next to the theory for fp32 AdamW (two fp32
  moments, 8 bytes per parameter, divided by dp under ZeRO 1-3; an fp32 parameter is its own master).
- the step's loss, which must be bitwise equal across AC modes: recomputation changes no number.

Savings are relative to AC none with ZeRO-0. The default model (debugmodel, seq_len 1024, 4 sequences
per rank, global batch 8) makes activations the bulk of the tensor memory and still runs in minutes
on two CPU cores. Quick mode (the tiny model at seq_len 64; for tests) runs only what the checks need:
AC none and full at ZeRO-0, and ZeRO-1 without AC.

Usage: python -m bench.memory [--steps N] [--quick]
"""

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from bench.common import print_table, run_torchpre
from torchpre.step_rules.zero_stages import zero_stage as zero_stage_row

DP = 2
ADAM_BYTES_PER_PARAM = 8
MiB = 2**20
AC_MODES = {
    "none": ["--activation_checkpoint.mode", "none"],
    "full": ["--activation_checkpoint.mode", "full"],
    "selective 2": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"],
    "selective op": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
}
ZERO_STAGES = (0, 1, 2, 3)
# ZeRO 2 and 3 change what is sharded, not what AC keeps: two AC modes each keep the run in minutes.
STAGE_AC_MODES = {0: list(AC_MODES), 1: list(AC_MODES), 2: ["none", "full"], 3: ["none", "full"]}
QUICK_CONFIGURATIONS = [("none", 0), ("full", 0), ("none", 1)]
MODEL = ["--model.flavor", "debugmodel", "--training.seq_len", "1024", "--training.local_batch_size", "4"]
QUICK_MODEL = ["--model.flavor", "tiny", "--training.seq_len", "64", "--training.local_batch_size", "4"]


@dataclass(frozen=True)
class Result:
    """One configuration's numbers at the last step, each the max over ranks."""

    ac_mode: str
    zero_stage: int
    loss: float
    rss_bytes: int
    tensor_peak_bytes: int
    activation_bytes: int
    optimizer_state_bytes: int
    num_params: int

    @property
    def shards_optimizer_state(self) -> bool:
        return zero_stage_row(self.zero_stage).shards_optimizer_state

    @property
    def optimizer_state_theory(self) -> float:
        return ADAM_BYTES_PER_PARAM * self.num_params / (DP if self.shards_optimizer_state else 1)


def measure(model: Sequence[str], ac_mode: str, zero_stage: int, steps: int) -> Result:
    """Trains one configuration in fresh processes (so peak RSS is its own) and reads its last step."""
    args = [*model, *AC_MODES[ac_mode], "--optimizer.zero_stage", str(zero_stage),
            "--training.steps", str(steps), "--metrics.log_freq", "1"]
    last: dict = {}
    for record in run_torchpre(args, nproc=DP, script="bench/memory_worker.py"):
        if record["step"] == steps:  # the trainer's record and the worker's, merged
            last.update(record)
    return Result(ac_mode, zero_stage, last["loss"], last["max_memory_bytes"], last["tensor_peak_bytes"],
                  last["activation_bytes"], last["optimizer_state_bytes"], last["num_params"])


def run(quick: bool, steps: int) -> list[Result]:
    """Each ZeRO stage with its AC modes, or quick mode's pairs, the baseline (none, ZeRO-0) first."""
    if quick:
        return [measure(QUICK_MODEL, mode, zero_stage, steps) for mode, zero_stage in QUICK_CONFIGURATIONS]
    return [measure(MODEL, mode, stage, steps) for stage in ZERO_STAGES for mode in STAGE_AC_MODES[stage]]


def loss_mismatches(results: Sequence[Result]) -> list[str]:
    """The ZeRO stages whose AC modes disagree on the loss in any bit (ZeRO stages may differ from each
    other: reduce-scatter sums in another order than all-reduce)."""
    mismatches = []
    for zero_stage in ZERO_STAGES:
        losses = {r.ac_mode: r.loss for r in results if r.zero_stage == zero_stage}
        if len(set(losses.values())) > 1:
            mismatches.append(f"ZeRO-{zero_stage}: {losses}")
    return mismatches


def print_results(results: Sequence[Result], steps: int, model: Sequence[str]) -> None:
    baseline = results[0]
    headers = ["AC mode", "ZeRO", f"step-{steps} loss", "peak RSS MiB", "RSS saving", "tensor peak MiB",
               "tensor saving", "activations MiB", "activation saving", "optimizer state MiB", "theory MiB"]
    rows = [
        [r.ac_mode, r.zero_stage, repr(r.loss),
         r.rss_bytes / MiB, _saving(r.rss_bytes, baseline.rss_bytes),
         r.tensor_peak_bytes / MiB, _saving(r.tensor_peak_bytes, baseline.tensor_peak_bytes),
         r.activation_bytes / MiB, _saving(r.activation_bytes, baseline.activation_bytes),
         r.optimizer_state_bytes / MiB, r.optimizer_state_theory / MiB]
        for r in results
    ]
    title = f"Peak memory per rank, dp={DP}, {' '.join(model)} ({baseline.num_params:,} parameters)"
    print_table(title, headers, rows)


def _saving(value: int, baseline: int) -> str:
    return f"{100 * (1 - value / baseline):.1f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="steps per run; the last is measured (at least 2, "
                        "so that the optimizer state exists during it)")
    parser.add_argument("--quick", action="store_true", help="the tiny model at seq_len 64, three configurations")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2: AdamW creates its state in the first step")
    results = run(args.quick, args.steps)
    print_results(results, args.steps, QUICK_MODEL if args.quick else MODEL)
    mismatches = loss_mismatches(results)
    if mismatches:
        sys.exit("losses differ across AC modes: " + "; ".join(mismatches))
    print(f"\nstep-{args.steps} losses are bitwise equal across AC modes at each ZeRO stage.")


if __name__ == "__main__":
    main()
