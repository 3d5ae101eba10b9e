"""Shard folders in the format `prepare` writes (torchpre/data/shards.py), written fast at any scale: 100,000 tiny
shards in seconds, or shards of billions of tokens each as sparse files (they read as token 0)."""

import json
import os
from pathlib import Path

import numpy as np

from torchpre.data.shards import FORMAT_VERSION, MANIFEST, token_dtype


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
