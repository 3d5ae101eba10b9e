"""Data at the scale of a real run (issue 66): how the data pipeline's costs grow with the shard count, the window
count and the number of sources. Each section prints a Markdown table; `--only NAME` runs one.

- prepare: `python -m torchpre.data.prepare` of the same short documents, one shard each (`--shard-tokens 1`), at
  1,000 and 10,000 shards: wall seconds and their ratio (target: at most 10x for 10x the shards).

Usage: python -m bench.data_scale [--only prepare]
"""

import argparse
import contextlib
import io
import json
import tempfile
import time
from pathlib import Path

from bench.common import print_table
from torchpre.data.prepare import main as prepare

SHARD_COUNTS = (1_000, 10_000)
PREPARE_TARGET = 10.0


def prepare_seconds(folder: Path, shards: int) -> float:
    """Wall seconds of `prepare` writing `shards` one-document shards (one worker)."""
    corpus = folder / f"corpus-{shards}.jsonl"
    texts = (f"document {i}: the quick brown fox jumps over the lazy dog {i % 97}" for i in range(shards))
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        prepare([str(corpus), "--output", str(folder / f"shards-{shards}"), "--shard-tokens", "1", "--workers", "1"])
    return time.perf_counter() - start


def prepare_section(folder: Path) -> None:
    seconds = {count: prepare_seconds(folder, count) for count in SHARD_COUNTS}
    small, large = SHARD_COUNTS
    ratio = seconds[large] / seconds[small]
    rows = [[f"{count:,}", f"{seconds[count]:.1f}", f"{seconds[count] / count * 1e3:.2f}"] for count in SHARD_COUNTS]
    print_table(f"prepare against the shard count: {large:,} / {small:,} shards = {ratio:.1f}x the time "
                f"({'pass' if ratio <= PREPARE_TARGET else 'FAIL'}: <= {PREPARE_TARGET:.0f}x)",
                ["shards", "seconds", "ms per shard"], rows)  # fmt: skip


SECTIONS = {"prepare": prepare_section}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=list(SECTIONS), help="run this section alone")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        for name, section in SECTIONS.items():
            if args.only in (None, name):
                section(Path(folder))


if __name__ == "__main__":
    main()
