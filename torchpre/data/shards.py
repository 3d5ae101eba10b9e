"""Pre-tokenized token shards: the on-disk format `python -m torchpre.data.prepare` writes and training
reads memory-mapped.

A shard folder holds
- `manifest.json`: the format version, the tokenizer's file name, SHA-256 and vocab size, the token
  dtype, per shard its name (a file name inside the folder), token and document counts and largest
  token id, whether `prepare` finished (`complete`), and `source`: what `prepare` made the shards
  from (input fingerprints and options), so that a rerun into the same folder can resume, or refuse
  other inputs;
- `NAME.bin`: whole documents (each BOS ... EOS) back to back, little-endian uint16 when the vocab
  fits (< 65,536 ids), else uint32;
- `NAME.idx`: little-endian int64 offsets into NAME.bin of each document's start, then the end
  (documents + 1 entries).

A shard is listed in the manifest only once both files are complete and flushed to disk, so an
interrupted `prepare` never leaves a shard that reads as valid, and a reader refuses a folder whose
`prepare` has not finished.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from torchpre.confined import confined_path, open_replacing, write_file
from torchpre.errors import FieldError, TorchpreError, field

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_OFFSET = np.dtype("<i8")


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type that holds every id."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    name: str
    num_tokens: int
    num_documents: int
    max_token_id: int | None = None  # None in manifests written before it was recorded, and for an empty shard


@dataclasses.dataclass
class Manifest:
    tokenizer_name: str
    tokenizer_sha256: str
    vocab_size: int
    shards: list[ShardInfo] = dataclasses.field(default_factory=list)
    version: int = FORMAT_VERSION
    complete: bool = True
    source: dict = dataclasses.field(default_factory=dict)

    @property
    def dtype(self) -> np.dtype:
        return token_dtype(self.vocab_size)

    @property
    def num_tokens(self) -> int:
        return sum(shard.num_tokens for shard in self.shards)

    @property
    def num_documents(self) -> int:
        return sum(shard.num_documents for shard in self.shards)

    def write(self, folder: Path) -> None:
        """Atomically (a new file renamed over the old), so a crash leaves the previous manifest intact and a
        symbolic link at its name is replaced, never written through."""
        record = dataclasses.asdict(self) | {"dtype": self.dtype.name, "num_tokens": self.num_tokens}
        write_file(folder / MANIFEST, json.dumps(record, indent=1))

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        """The manifest of `folder`, every field checked: a missing one or one of the wrong type is an error naming
        the file and the key, never a crash later on."""
        path = folder / MANIFEST
        if not path.is_file():
            raise TorchpreError(
                f"{folder} is not a shard folder: it has no {MANIFEST}. "
                "Create one with `python -m torchpre.data.prepare INPUT... --output DIR`."
            )
        try:
            manifest = cls._from_record(json.loads(path.read_text(encoding="utf-8")))
        except (json.JSONDecodeError, UnicodeDecodeError, FieldError) as error:
            raise TorchpreError(f"{path} is not a valid shard manifest ({error}). Re-run prepare.") from None
        for i, shard in enumerate(manifest.shards):
            for suffix in (".bin", ".idx"):
                confined_path(folder, f"{shard.name}{suffix}", path, f"shards[{i}].name")
        if manifest.version != FORMAT_VERSION:
            raise TorchpreError(
                f"{path} has format version {manifest.version}; this torchpre reads version {FORMAT_VERSION}. "
                "Re-run prepare with this version."
            )
        return manifest

    @classmethod
    def _from_record(cls, record: object) -> Manifest:
        """The manifest a parsed `manifest.json` holds; a FieldError names the first field that is missing, of the
        wrong type, or (dtype, num_tokens: derived fields) at odds with the others."""
        shards = [
            ShardInfo(
                field(shard, "name", str, f"shards[{i}]"),
                _count(shard, "num_tokens", f"shards[{i}]"),
                _count(shard, "num_documents", f"shards[{i}]"),
                field(shard, "max_token_id", (int, type(None)), f"shards[{i}]", default=None),
            )
            for i, shard in enumerate(field(record, "shards", list))
        ]
        manifest = cls(
            field(record, "tokenizer_name", str),
            field(record, "tokenizer_sha256", str),
            _count(record, "vocab_size"),
            shards,
            field(record, "version", int),
            # Absent from manifests written before these fields existed: those were complete.
            field(record, "complete", bool, default=True),
            field(record, "source", dict, default={}),
        )
        if field(record, "dtype", str) != manifest.dtype.name:
            raise FieldError(
                f"'dtype' is {record['dtype']!r}, but vocab_size {manifest.vocab_size} stores tokens as "
                f"{manifest.dtype.name!r}"
            )
        if _count(record, "num_tokens") != manifest.num_tokens:
            raise FieldError(f"'num_tokens' is {record['num_tokens']}, but the shards hold {manifest.num_tokens}")
        return manifest


def _count(record: object, key: str, where: str = "") -> int:
    """A field that counts something: an integer, never negative."""
    value = field(record, key, int, where)
    if value < 0:
        raise FieldError(f"'{f'{where}.{key}' if where else key}' is {value}, not a count (0 or more)")
    return value


def write_shard(folder: Path, name: str, documents: Sequence[Sequence[int]], vocab_size: int) -> ShardInfo:
    """Writes NAME.bin and NAME.idx for already framed (BOS ... EOS) token documents (lists or arrays).

    Both files are on disk (fsync) when this returns, so a manifest written next never lists a shard
    that a crash could still lose; each is a new file renamed into place, so a symbolic link left at its name (by
    whoever made the folder) is replaced, never written through.
    """
    dtype = token_dtype(vocab_size)
    lengths = np.fromiter(map(len, documents), dtype=_OFFSET, count=len(documents))
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(_OFFSET)
    tokens = np.concatenate([np.asarray(doc, dtype=dtype) for doc in documents]) if documents else np.empty(0, dtype)
    _write_durably(folder / f"{name}.bin", tokens)
    _write_durably(folder / f"{name}.idx", offsets)
    return ShardInfo(name, int(offsets[-1]), len(documents), int(tokens.max()) if len(tokens) else None)


def _write_durably(path: Path, array: np.ndarray) -> None:
    with open_replacing(path, durable=True) as file:
        array.tofile(file)


def shard_file_problem(folder: Path, manifest: Manifest, shard: ShardInfo) -> str | None:
    """What is wrong with `shard`'s files (missing, or sizes other than the manifest's counts), or None."""
    files = ((".bin", manifest.dtype, shard.num_tokens), (".idx", _OFFSET, shard.num_documents + 1))
    for suffix, dtype, count in files:
        path = folder / f"{shard.name}{suffix}"
        expected = count * dtype.itemsize
        actual = path.stat().st_size if path.is_file() else None
        if actual != expected:
            found = "is missing" if actual is None else f"has {actual:,} bytes"
            return f"Shard file {path} {found}, but {MANIFEST} says {expected:,} bytes ({count:,} x {dtype.name})"
    return None


def out_of_vocabulary(path: Path, token_id: int, vocab_size: int, where: str) -> str:
    """The message for a token id that no embedding row holds, found in the shard file `path` (`where`)."""
    return (
        f"{path}: {where} token id {token_id:,}, but the vocabulary its manifest names has {vocab_size:,} ids "
        f"(0 to {vocab_size - 1:,}). The shard was not written by `python -m torchpre.data.prepare` with this "
        "tokenizer, or was altered; re-run prepare."
    )


class ShardReader:
    """Random access to the tokens of a shard folder, memory-mapped (nothing is read until used).

    `expected_tokenizer_sha256` guards against training on ids from another tokenizer; every shard's
    files are checked against the manifest's counts, so a truncated or missing file fails here, by
    name, rather than as garbage tokens mid-run.
    """

    def __init__(self, folder: str | os.PathLike, expected_tokenizer_sha256: str | None = None) -> None:
        self.folder = Path(folder)
        self.manifest = Manifest.read(self.folder)
        if expected_tokenizer_sha256 and self.manifest.tokenizer_sha256 != expected_tokenizer_sha256:
            raise TorchpreError(
                f"The shards in {self.folder} were made with tokenizer '{self.manifest.tokenizer_name}' "
                f"(sha256 {self.manifest.tokenizer_sha256[:12]}...), not with this run's model.tokenizer_path "
                f"(sha256 {expected_tokenizer_sha256[:12]}...). Re-run prepare with this tokenizer, or set "
                "model.tokenizer_path to the one the shards were made with."
            )
        if not self.manifest.complete:
            raise TorchpreError(
                f"The shard folder {self.folder} is incomplete: `python -m torchpre.data.prepare` was interrupted "
                f"after {len(self.shards)} shards. Re-run the same prepare command to finish it."
            )
        for shard in self.shards:
            if shard.max_token_id is not None and shard.max_token_id >= self.manifest.vocab_size:
                raise TorchpreError(out_of_vocabulary(self.folder / f"{shard.name}.bin", shard.max_token_id,
                                                      self.manifest.vocab_size, "its manifest records"))  # fmt: skip
            problem = shard_file_problem(self.folder, self.manifest, shard)
            if problem:
                raise TorchpreError(
                    f"{problem}: the file is truncated or from another run. Re-run prepare for this folder."
                )
        self.tokens = [self._map(shard.name, ".bin", self.manifest.dtype, shard.num_tokens) for shard in self.shards]
        self.offsets = [self._map(shard.name, ".idx", _OFFSET, shard.num_documents + 1) for shard in self.shards]

    @property
    def shards(self) -> list[ShardInfo]:
        return self.manifest.shards

    def _map(self, name: str, suffix: str, dtype: np.dtype, count: int) -> np.ndarray:
        if count == 0:
            return np.empty(0, dtype=dtype)
        return np.memmap(self.folder / f"{name}{suffix}", dtype=dtype, mode="r", shape=(count,))

    def document(self, shard: int, index: int) -> np.ndarray:
        """The framed tokens of one document."""
        start, end = self.offsets[shard][index], self.offsets[shard][index + 1]
        return self.tokens[shard][start:end]
