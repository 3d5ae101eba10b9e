"""Data pipeline throughput: `torchpre.data.prepare` (MB/s and tokens/s per core) and the shard loader
(tokens/s) against what training the debug model consumes, in one invocation.

The input is the built-in corpus (the standard library's docstrings) repeated to `--megabytes` of
JSON lines. The loader is timed over `--batches` microbatches of the debug run's shape (seq_len 256,
batch 8) with 0 and 2 workers; the consumption is the debug model's steady-state tokens/s in one
process. Target: the loader at least 20x the consumption.

prepare against its tokenizer's own library, per core on the same text: the tiktoken file (tiktoken's
`encode_ordinary_batch` on one thread) and a Hugging Face tokenizer.json (byte-level BPE as Qwen ships it,
scripts/tiny_tokenizer.py; the `tokenizers` library's `encode_batch` and `encode_batch_fast` on one thread, with the
`.ids` of the encodings they return, the faster of the two). Each is CPU time of this process, the best of `--repeats`
interleaved runs (the machine is shared); prepare also reads, parses and checks the JSON lines, frames the documents
and writes the shards. Target: prepare at least 0.9x the library.   Usage: python -m bench.data
"""

import argparse
import contextlib
import io
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import tiktoken

from bench.common import print_table, run_torchpre, steady
from scripts import tiny_tokenizer
from torchpre.data.corpus import stdlib_documents
from torchpre.data.loader import build_dataloader
from torchpre.data.prepare import main as prepare
from torchpre.data.tiktoken_bpe import LLAMA3_PAT_STR, load_ranks
from torchpre.data.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer

TARGET_RATIO = 20.0
TARGET_PREPARE = 0.9  # prepare's MB/s per core over its tokenizer library's, on the same text


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


def time_prepare(
    corpus: Path, output: Path, workers: int, tokenizer: Path = DEFAULT_TOKENIZER_PATH, clock=time.perf_counter
) -> tuple[float, int]:
    """(seconds on `clock`, tokens) of one `prepare` run, its own summary silenced."""
    start = clock()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        prepare([str(corpus), "--output", str(output), "--workers", str(workers), "--tokenizer", str(tokenizer)])
    seconds = clock() - start
    tokens = json.loads((output / "manifest.json").read_text())["num_tokens"]
    return seconds, tokens


def library_encoders(tokenizer: Path) -> dict[str, Callable[[list[str]], object]]:
    """The tokenizer library's own batch encoding of a tokenizer file or folder into lists of ids, on one thread (the
    `tokenizers` library returns Encoding objects: their `.ids` are the lists tiktoken returns)."""
    if tokenizer.is_dir():
        import tokenizers

        library = tokenizers.Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
        return {
            "encode_batch, .ids": lambda texts: [e.ids for e in library.encode_batch(texts, add_special_tokens=False)],
            "encode_batch_fast, .ids": lambda texts: [
                e.ids for e in library.encode_batch_fast(texts, add_special_tokens=False)
            ],
        }  # fmt: skip
    encoding = tiktoken.Encoding(tokenizer.name, pat_str=LLAMA3_PAT_STR, mergeable_ranks=load_ranks(tokenizer),
                                 special_tokens={})  # fmt: skip
    return {"encode_ordinary_batch": lambda texts: encoding.encode_ordinary_batch(texts, num_threads=1)}


def prepare_against_library(corpus: Path, folder: Path, tokenizer: Path, repeats: int) -> tuple[float, float, str]:
    """(library MB/s, prepare MB/s, the library call) on one core: CPU seconds of this process, the best of `repeats`
    interleaved runs of each."""
    texts = [json.loads(line)["text"] for line in corpus.read_text(encoding="utf-8").splitlines()]
    size = sum(len(text.encode()) for text in texts) / 2**20
    library: dict[str, float] = {}
    prepared = []
    for repeat in range(repeats):
        for name, encode in library_encoders(tokenizer).items():
            start = time.process_time()
            encode(texts)
            library[name] = min(library.get(name, float("inf")), time.process_time() - start)
        output = folder / f"prepared-{tokenizer.name}-{repeat}"
        prepared.append(time_prepare(corpus, output, 1, tokenizer, clock=time.process_time)[0])
    name = min(library, key=library.get)
    return size / library[name], size / min(prepared), name


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
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs of prepare and of each library call")
    args = parser.parse_args()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread: per core, as prepare's workers run
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
        hugging_face = tiny_tokenizer.write("byte_level", Path(folder) / "byte_level")
        rows = []
        for label, tokenizer in (("tiktoken (shipped)", DEFAULT_TOKENIZER_PATH), ("tokenizers (byte-level BPE)",
                                                                                  hugging_face)):  # fmt: skip
            library, prepared, call = prepare_against_library(corpus, Path(folder), tokenizer, args.repeats)
            ratio = prepared / library
            rows.append([label, call, library, prepared, f"{ratio:.2f}x",
                         "pass" if ratio >= TARGET_PREPARE else "FAIL"])  # fmt: skip
        print_table("prepare vs its tokenizer library, one core, same text (CPU time, best of "
                    f"{args.repeats})", ["tokenizer", "library call", "library MB/s", "prepare MB/s",
                                         "prepare / library", f">= {TARGET_PREPARE}x"], rows)  # fmt: skip
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
