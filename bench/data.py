"""Data pipeline throughput: `torchpre.data.prepare` (MB/s and tokens/s per core) and the shard loader
(tokens/s) against what training the debug model consumes, in one invocation.

The input is the built-in corpus (the standard library's docstrings) repeated to `--megabytes` of
JSON lines. The loader is timed over `--batches` microbatches of the debug run's shape (seq_len 256,
batch 8) with 0 and 2 workers; the consumption is the debug model's steady-state tokens/s in one
process. Target: the loader at least 20x the consumption.   Usage: python -m bench.data
"""

import argparse
import contextlib
import io
import json
import tempfile
import time
from pathlib import Path

from bench.common import print_table, run_torchpre, steady
from torchpre.data.corpus import stdlib_documents
from torchpre.data.loader import build_dataloader
from torchpre.data.prepare import main as prepare
from torchpre.data.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer

TARGET_RATIO = 20.0


def write_corpus(path: Path, megabytes: float) -> int:
    """The stdlib corpus as JSON lines, repeated until `megabytes`; returns the bytes written."""
    documents = [json.dumps({"text": text}) + "\n" for text in stdlib_documents()]
    written, limit = 0, int(megabytes * 2**20)
    with path.open("w", encoding="utf-8") as file:
        while written < limit:
            for line in documents:
                file.write(line)
                written += len(line.encode())
    return written


def time_prepare(corpus: Path, output: Path, workers: int) -> tuple[float, int]:
    """(seconds, tokens) of one `prepare` run, its own summary silenced."""
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        prepare([str(corpus), "--output", str(output), "--workers", str(workers)])
    seconds = time.perf_counter() - start
    tokens = json.loads((output / "manifest.json").read_text())["num_tokens"]
    return seconds, tokens


def loader_tokens_per_sec(shards: Path, num_workers: int, batches: int, seq_len: int, batch_size: int) -> float:
    """Tokens/s of iterating the shard loader (one DP rank of one), after its workers have started."""
    loader = build_dataloader(
        dataset="shards", dataset_path=str(shards), tokenizer=load_tokenizer(DEFAULT_TOKENIZER_PATH), seq_len=seq_len,
        local_batch_size=batch_size, global_batch_size=batch_size, dp_rank=0, dp_size=1, seed=0,
        num_workers=num_workers, vocab_size=load_tokenizer(DEFAULT_TOKENIZER_PATH).vocab_size,
    )
    iterator = iter(loader)
    next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return batches * batch_size * seq_len / (time.perf_counter() - start)


def training_tokens_per_sec(steps: int) -> float:
    records = run_torchpre(["--model.flavor", "debugmodel", "--training.seq_len", "256", "--training.local_batch_size",
                            "8", "--training.steps", str(steps), "--metrics.log_freq", "1"])
    return steady(records, "tokens_per_sec", warmup=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=float, default=20.0, help="size of the JSON-lines input")
    parser.add_argument("--batches", type=int, default=500, help="loader microbatches timed")
    parser.add_argument("--train-steps", type=int, default=8, help="debug-model steps for the consumption rate")
    args = parser.parse_args()
    seq_len, batch_size = 256, 8
    with tempfile.TemporaryDirectory() as folder:
        corpus = Path(folder) / "corpus.jsonl"
        size = write_corpus(corpus, args.megabytes)
        rows = []
        for workers in (1, 2):
            seconds, tokens = time_prepare(corpus, Path(folder) / f"shards{workers}", workers)
            rows.append([workers, size / 2**20 / seconds / workers, tokens / seconds / workers, tokens / seconds])
        print_table(f"prepare: {size / 2**20:.1f} MB of JSON lines", ["workers", "MB/s per core",
                    "tokens/s per core", "tokens/s"], rows)
        consumption = training_tokens_per_sec(args.train_steps)
        rows = []
        for workers in (0, 2):
            rate = loader_tokens_per_sec(Path(folder) / "shards1", workers, args.batches, seq_len, batch_size)
            ratio = rate / consumption
            rows.append([workers, rate, consumption, f"{ratio:.0f}x", "pass" if ratio >= TARGET_RATIO else "FAIL"])
        print_table(f"shard loader vs debug-model training (seq_len {seq_len}, batch {batch_size}, one process)",
                    ["loader workers", "loader tokens/s", "training tokens/s", "ratio", f">= {TARGET_RATIO:.0f}x"],
                    rows)


if __name__ == "__main__":
    main()
