"""Context parallelism at a long sequence: per-rank memory against one process, throughput against dp2 and tp2 at
the same global batch, and how evenly the head-tail split shares the attention work.

Every layout trains the debug model (--quick: the tiny one) at --seq-len on 2 sequences per step twice: through
bench/memory_worker.py (the real Trainer under the tensor-memory counter that bench/memory.py uses), which gives, as
the max over ranks, the tensor peak and the activations kept for backward, each as a fraction of one process's; and
through train.py itself, whose steady tokens/s is the throughput (the counter intercepts every operation, which
slows most the layouts that run many small ones). The balance table counts the (query, key) pairs each rank's
queries attend under the causal mask, for the head-tail split and for a contiguous one, at cp 2, 4 and 8.

Usage: python -m bench.context_parallel [--seq-len N] [--steps N] [--quick]
"""

import argparse
from collections.abc import Sequence

from bench.common import print_table, run_torchpre, steady
from torchpre.parallel.context_parallel import head_tail_positions

MODEL = ["--model.flavor", "debugmodel"]
QUICK_MODEL = ["--model.flavor", "tiny"]
GLOBAL_BATCH = 2
# name: (processes, options); every layout trains 2 sequences per step.
LAYOUTS = {
    "1 process": (1, ["--training.local_batch_size", "2"]),
    "cp2": (2, ["--training.local_batch_size", "2", "--parallelism.context_parallel_degree", "2"]),
    "dp2": (2, ["--training.local_batch_size", "1"]),
    "tp2": (2, ["--training.local_batch_size", "2", "--parallelism.tensor_parallel_degree", "2"]),
}


def measure(model: Sequence[str], seq_len: int, steps: int) -> dict[str, dict]:
    """Each layout's last-step memory record and steady tokens/s."""
    results = {}
    for name, (nproc, layout) in LAYOUTS.items():
        args = [*model, *layout, "--training.seq_len", str(seq_len), "--training.steps", str(steps),
                "--training.global_batch_size", str(GLOBAL_BATCH), "--metrics.log_freq", "1"]  # fmt: skip
        records = run_torchpre(args, nproc=nproc, script="bench/memory_worker.py")
        last = {}
        for record in records:
            if record["step"] == steps:  # the trainer's record and the worker's, merged
                last.update(record)
        trainer_records = [r for r in records if "tokens_per_sec" in r]
        last["counted_tokens_per_sec"] = steady(trainer_records, "tokens_per_sec", warmup=min(2, steps - 1))
        plain = run_torchpre(args, nproc=nproc)
        last["steady_tokens_per_sec"] = steady(plain, "tokens_per_sec", warmup=min(2, steps - 1))
        last["plain_loss"] = plain[-1]["loss"]
        results[name] = last
    return results


def attention_pairs(seq_len: int, cp: int, head_tail: bool) -> list[int]:
    """Causally attended (query, key) pairs per cp rank: position p attends p + 1 keys."""
    chunk = seq_len // cp
    shards = [
        head_tail_positions(seq_len, cp, rank) if head_tail else list(range(rank * chunk, (rank + 1) * chunk))
        for rank in range(cp)
    ]
    return [int(sum(p + 1 for p in map(int, shard))) for shard in shards]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="the tiny model at seq 256 (for tests)")
    args = parser.parse_args()
    seq_len = 256 if args.quick else args.seq_len
    results = measure(QUICK_MODEL if args.quick else MODEL, seq_len, args.steps)
    one = results["1 process"]
    rows = [
        (name, r["tensor_peak_bytes"] / 2**20, r["tensor_peak_bytes"] / one["tensor_peak_bytes"],
         r["activation_bytes"] / 2**20, r["activation_bytes"] / one["activation_bytes"], r["steady_tokens_per_sec"],
         r["steady_tokens_per_sec"] / one["steady_tokens_per_sec"], r["counted_tokens_per_sec"], f"{r['loss']:.4f}")
        for name, r in results.items()
    ]  # fmt: skip
    print_table(
        f"Per rank at seq_len {seq_len}, {GLOBAL_BATCH} sequences per step (max over ranks)",
        ["layout", "tensor peak MiB", "x 1 process", "activations MiB", "x 1 process", "tokens/s", "x 1 process",
         "tokens/s under the counter", "last loss"],
        rows,
    )  # fmt: skip
    balance = []
    for cp in (2, 4, 8):
        head_tail, contiguous = attention_pairs(seq_len, cp, True), attention_pairs(seq_len, cp, False)
        balance.append((cp, max(head_tail) / min(head_tail), max(contiguous) / min(contiguous)))
    print_table(
        "Attention work per rank, max / min over the cp ranks",
        ["cp", "head-tail", "contiguous"],
        balance,
    )


if __name__ == "__main__":
    main()
