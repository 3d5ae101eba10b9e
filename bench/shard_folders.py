"""Shard folders in the format `prepare` writes (torchpre/data/shards.py), written fast at any scale: 100,000 tiny
shards in seconds, or shards of billions of tokens each as sparse files (they read as token 0); and one training
step on such a folder, timed and measured (tests/integration/test_shard_scale.py, bench/data_scale.py)."""

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from torchpre.data.shards import FORMAT_VERSION, MANIFEST, token_dtype
from torchpre.data.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = load_tokenizer(DEFAULT_TOKENIZER_PATH)
DESCRIPTORS = 1024  # the smallest usual limit of open files
# The tiny model on short windows (tests/launch.py's TINY), one step.
ONE_STEP = ["--model.flavor", "tiny", "--training.seq_len", "32", "--training.local_batch_size", "4",
            "--lr_scheduler.warmup_steps", "2", "--training.steps", "1"]  # fmt: skip


def write_many_shards(
    folder: Path,
    count: int,
    tokens_per_shard: int,
    *,
    vocab_size: int,
    tokenizer_name: str,
    sha256: str,
    seed: int = 0,
    sparse: bool = False,
) -> Path:
    """A complete shard folder of `count` shards of `tokens_per_shard` tokens, one document each.

    Each shard holds a seeded random document of ids in [1, min(vocab_size, 2,000)) (`sparse`: zeros, files of that
    size with no blocks written, for folders of trillions of tokens); its `.idx` is [0, tokens_per_shard]. Written
    with raw descriptors, not `write_shard`'s renames and fsyncs: this is a test's scratch folder."""
    folder.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(vocab_size)
    nbytes = tokens_per_shard * dtype.itemsize
    offsets = np.array([0, tokens_per_shard], dtype="<i8").tobytes()
    rng = np.random.default_rng(seed)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    for index in range(count):
        name = folder / f"shard_{index:06d}"
        fd = os.open(f"{name}.bin", flags, 0o644)
        try:
            if sparse:
                os.ftruncate(fd, nbytes)
            else:
                os.write(fd, rng.integers(1, min(vocab_size, 2000), tokens_per_shard).astype(dtype).tobytes())
        finally:
            os.close(fd)
        fd = os.open(f"{name}.idx", flags, 0o644)
        try:
            os.write(fd, offsets)
        finally:
            os.close(fd)
    largest = 0 if sparse else min(vocab_size, 2000) - 1
    shard = {"num_tokens": tokens_per_shard, "num_documents": 1, "max_token_id": largest}
    record = {
        "tokenizer_name": tokenizer_name,
        "tokenizer_sha256": sha256,
        "vocab_size": vocab_size,
        "shards": [{"name": f"shard_{index:06d}", **shard} for index in range(count)],
        "version": FORMAT_VERSION,
        "complete": True,
        "source": {},
        "dtype": dtype.name,
        "num_tokens": count * tokens_per_shard,
    }
    (folder / MANIFEST).write_text(json.dumps(record))
    return folder


def open_descriptors() -> int:
    """How many descriptors this process holds now."""
    return len(os.listdir("/proc/self/fd"))


def shard_folder(folder: Path, count: int, tokens_per_shard: int = 64, sparse: bool = False) -> Path:
    """`write_many_shards` for the shipped tokenizer."""
    return write_many_shards(folder, count, tokens_per_shard, vocab_size=TOKENIZER.vocab_size, sparse=sparse,
                             tokenizer_name=DEFAULT_TOKENIZER_PATH.name, sha256=TOKENIZER.sha256)  # fmt: skip


def train_one_step(folder: Path, dump: Path, *args: str) -> tuple[float, int]:
    """(seconds, peak RSS in bytes) of train.py running one step on `folder` in a fresh process held to
    `DESCRIPTORS` open files."""
    command = [sys.executable, "train.py", *ONE_STEP, "--training.dataset", "shards", "--training.dataset_path",
               str(folder), "--job.dump_folder", str(dump), *args]  # fmt: skip
    dump.mkdir(parents=True)
    with (dump / "out.txt").open("w") as out:
        start = time.perf_counter()
        process = subprocess.Popen(command, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=out,
                                   stderr=out, preexec_fn=_limit_descriptors)  # fmt: skip
        _, status, usage = os.wait4(process.pid, 0)  # this child's own peak RSS, which Popen.wait would not give
        seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"train.py failed on {folder}:\n{(dump / 'out.txt').read_text()[-3000:]}")
    return seconds, usage.ru_maxrss * 1024


def _limit_descriptors() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (DESCRIPTORS, DESCRIPTORS))
