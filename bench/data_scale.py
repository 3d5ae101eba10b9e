"""Data at the scale of a real run (issue 66): how the data pipeline's costs grow with the shard count, the window
count and the number of sources. Each section prints a Markdown table; `--only NAME` runs one.

- shards: train.py, one step of the tiny model, on 100,000 tiny shards and on 10 (bench/shard_folders.py writes them),
  each a fresh process held to 1,024 open files: wall seconds to the end of step 1 and peak RSS (targets: within 2x
  and 10% of the 10-shard folder's).
- trillion: the same on 1,000 sparse shards of a billion tokens each (10^12 tokens; they read as token 0), against
  10 shards (targets: at most 30 s, 2 GiB).
- order: the memory of the sample order of one rank against the number of windows, up to 15T tokens at seq_len
  8,192 (1.8 billion windows): version 1 (`EpochShuffle`, a permutation of the windows: measured where it fits, else
  its 8 bytes a window) and version 2 (`FeistelShuffle`, measured with tracemalloc), and version 2's time per
  position.
- mixture: the order's time per sample of a mixture of 10, 100 and 1,000 sources (target: 1,000 within 2x of 10).
- cold: random windows (seq_len 256) of 10 shards of 50M tokens (1 GB) whose pages were just dropped from the page
  cache (posix_fadvise DONTNEED), read one by one, and a batch of 32 at a time as the loader reads them
  (`ShardWindows.__getitems__`: the kernel is asked for the whole batch first), and the same windows warm.
- prepare: `python -m torchpre.data.prepare` of the same short documents, one shard each (`--shard-tokens 1`), at
  1,000 and 10,000 shards: wall seconds (the best of 2 interleaved runs) and their ratio (target: at most 10x for
  10x the shards).

Usage: python -m bench.data_scale [--only shards|trillion|order|mixture|cold|prepare]
"""

import argparse
import contextlib
import io
import json
import os
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from bench.common import print_table
from bench.shard_folders import TOKENIZER, shard_folder, train_one_step
from torchpre.data.mixture import MixtureOrder, Source
from torchpre.data.prepare import main as prepare
from torchpre.data.sampler import EpochShuffle, FeistelShuffle
from torchpre.data.shard_dataset import ShardWindows

SHARD_COUNTS = (1_000, 10_000)
PREPARE_TARGET = 10.0
PREPARE_RUNS = 2


def prepare_seconds(folder: Path, shards: int, run: int) -> float:
    """Wall seconds of `prepare` writing `shards` one-document shards (one worker)."""
    corpus = folder / f"corpus-{shards}.jsonl"
    texts = (f"document {i}: the quick brown fox jumps over the lazy dog {i % 97}" for i in range(shards))
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        prepare([str(corpus), "--output", str(folder / f"shards-{shards}-{run}"), "--shard-tokens", "1", "--workers",
                 "1"])  # fmt: skip
    return time.perf_counter() - start


def prepare_section(folder: Path) -> None:
    seconds: dict[int, float] = {}
    for run in range(PREPARE_RUNS):  # interleaved, the best of each: the machine and its disk are shared
        for count in SHARD_COUNTS:
            seconds[count] = min(seconds.get(count, float("inf")), prepare_seconds(folder, count, run))
    small, large = SHARD_COUNTS
    ratio = seconds[large] / seconds[small]
    rows = [[f"{count:,}", f"{seconds[count]:.1f}", f"{seconds[count] / count * 1e3:.2f}"] for count in SHARD_COUNTS]
    print_table(f"prepare against the shard count: {large:,} / {small:,} shards = {ratio:.1f}x the time "
                f"({'pass' if ratio <= PREPARE_TARGET else 'FAIL'}: <= {PREPARE_TARGET:.0f}x)",
                ["shards", "seconds", "ms per shard"], rows)  # fmt: skip


GiB = 2**30
ORDER_TOKENS = (2 * 10**9, 10**11, 10**12, 15 * 10**12)
ORDER_SEQ_LEN = 8192
MEASURED_V1_LIMIT = 10**8  # windows: a version 1 permutation allocated for real up to 800 MB
MIXTURE_SOURCES = (10, 100, 1000)


def runs_section(folder: Path, name: str, count: int, tokens_per_shard: int, sparse: bool) -> None:
    few_seconds, few_rss = train_one_step(shard_folder(folder / f"{name}-few", 10), folder / f"{name}-run-few")
    many = shard_folder(folder / name, count, tokens_per_shard, sparse)
    seconds, rss = train_one_step(many, folder / f"{name}-run")
    rows = [[f"{count:,} x {tokens_per_shard:,}", f"{seconds:.1f}", f"{rss / 2**20:,.0f}"],
            ["10 x 64", f"{few_seconds:.1f}", f"{few_rss / 2**20:,.0f}"]]  # fmt: skip
    verdicts = f"time {seconds / few_seconds:.2f}x, RSS {rss / few_rss:.3f}x the 10-shard folder's"
    print_table(f"train.py, one step, <= 1,024 open files: {verdicts}", ["shards x tokens", "seconds to the end of "
                "step 1", "peak RSS MiB"], rows)  # fmt: skip


def shards_section(folder: Path) -> None:
    runs_section(folder, "many", 100_000, 64, sparse=False)


def trillion_section(folder: Path) -> None:
    runs_section(folder, "trillion", 1000, 10**9, sparse=True)


def order_section(folder: Path) -> None:
    rows = []
    for tokens in ORDER_TOKENS:
        windows = tokens // (ORDER_SEQ_LEN + 1)
        if windows <= MEASURED_V1_LIMIT:
            epoch = EpochShuffle(windows, 0)
            epoch(0)
            v1 = f"{epoch._permutation.nbytes / 2**20:,.1f} MiB (its permutation, allocated)"
            del epoch
        else:
            v1 = f"{8 * windows / 2**20:,.0f} MiB (8 bytes a window, not allocated here)"
        FeistelShuffle(7, 1)(0)  # numpy's first SeedSequence sets up caches of its own: not the order's memory
        order = FeistelShuffle(windows, 0)
        v2 = _peak_bytes(lambda: [order(p) for p in (0, 1, windows - 1, windows, 3 * windows + 5)])
        start = time.perf_counter()
        for position in range(20_000):
            order(position)
        per_position = (time.perf_counter() - start) / 20_000 * 1e6
        rows.append([_tokens(tokens), f"{windows:,}", v1, f"{v2:,}", f"{per_position:.1f}"])
    print_table(f"the sample order of one rank, seq_len {ORDER_SEQ_LEN:,}", ["tokens", "windows", "version 1 memory",
                "version 2 peak bytes (5 positions, 3 epochs)", "version 2 us per position"], rows)  # fmt: skip


def _tokens(count: int) -> str:
    return f"{count / 1e12:g}T" if count >= 10**12 else f"{count / 1e9:g}B"


def _peak_bytes(work) -> int:
    tracemalloc.start()
    work()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def mixture_section(folder: Path) -> None:
    costs = {}
    for count in MIXTURE_SOURCES:
        order = MixtureOrder([Source(f"s{i}", 10**9 + i, 1.0 + i % 7) for i in range(count)], seed=0)
        start = time.perf_counter()
        for position in range(50_000):
            order(position)
        costs[count] = (time.perf_counter() - start) / 50_000 * 1e6
    ratio = costs[MIXTURE_SOURCES[-1]] / costs[MIXTURE_SOURCES[0]]
    print_table(f"mixture order, time per sample: {MIXTURE_SOURCES[-1]:,} sources {ratio:.2f}x {MIXTURE_SOURCES[0]}'s "
                f"({'pass' if ratio <= 2 else 'FAIL'}: <= 2x)", ["sources", "us per sample"],
                [[f"{count:,}", f"{costs[count]:.1f}"] for count in MIXTURE_SOURCES])  # fmt: skip


COLD_WINDOWS, COLD_BATCH, COLD_RUNS = 4000, 32, 5


def cold_section(folder: Path) -> None:
    shards = shard_folder(folder / "cold", 10, 50_000_000)
    windows = ShardWindows(str(shards), 256, TOKENIZER.sha256, TOKENIZER.vocab_size)
    indices = [int(i) for i in np.random.default_rng(0).integers(0, len(windows), COLD_WINDOWS)]
    batches = [indices[k : k + COLD_BATCH] for k in range(0, len(indices), COLD_BATCH)]
    ways = {
        "one by one, cold": lambda: [windows[i] for i in indices],
        f"batches of {COLD_BATCH} (__getitems__), cold": lambda: [windows.__getitems__(b) for b in batches],
    }
    rates: dict[str, list[float]] = {}
    for _ in range(COLD_RUNS):  # interleaved: the machine is shared
        for name, read in ways.items():
            _drop_cached(shards)
            start = time.perf_counter()
            read()
            rates.setdefault(name, []).append(COLD_WINDOWS * 256 / (time.perf_counter() - start))
    start = time.perf_counter()
    [windows[i] for i in indices]
    rates["one by one, warm"] = [COLD_WINDOWS * 256 / (time.perf_counter() - start)]
    print_table(f"random windows of 256 tokens from 1 GB of shards, tokens/s (best of {len(rates[name])})",
                ["read", "tokens/s"], [[name, max(rate)] for name, rate in rates.items()])  # fmt: skip


def _drop_cached(folder: Path) -> None:
    """Evicts the shard files' pages from the page cache (clean pages: no privilege needed)."""
    for path in folder.glob("*.bin"):
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


SECTIONS = {
    "shards": shards_section,
    "trillion": trillion_section,
    "order": order_section,
    "mixture": mixture_section,
    "cold": cold_section,
    "prepare": prepare_section,
}


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
