"""Steady-state tokens/s, MFU and memory of one training run, from its metrics.jsonl.

Usage: python -m bench.summarize OUTPUT/metrics.jsonl [--warmup 5] [--label NAME]
"""

import argparse
import json
from pathlib import Path

from bench.common import print_table, steady


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("metrics", type=Path)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out (compilation, warm-up)")
    parser.add_argument("--label", default="torchpre")
    args = parser.parse_args()
    records = [json.loads(line) for line in args.metrics.read_text().splitlines()]
    row = [
        args.label,
        steady(records, "tokens_per_sec", args.warmup),
        f"{steady(records, 'mfu', args.warmup):.1%}",
        steady(records, "step_time_s", args.warmup),
        f"{max(r['max_memory_bytes'] for r in records) / 2**30:.1f}",
    ]
    print_table(
        f"steady state (median of steps after {args.warmup})",
        ["run", "tokens/s", "MFU", "step time (s)", "peak memory (GiB)"],
        [row],
    )


if __name__ == "__main__":
    main()
