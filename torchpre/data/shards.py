"""Pre-tokenized token shards: the on-disk format `python -m torchpre.data.prepare` writes and training
reads memory-mapped.

A shard folder holds
- `manifest.json`: the format version, the tokenizer's name, SHA-256 (`Tokenizer.sha256`) and vocab size, the token
  dtype, per shard its name (a file name inside the folder), token and document counts and largest
  token id, whether `prepare` finished (`complete`), and `source`: what `prepare` made the shards
  from (input fingerprints and options), so that a rerun into the same folder can resume, or refuse
  other inputs;
- `NAME.bin`: whole documents (each BOS ... EOS, or ... EOS for a tokenizer without a BOS) back to back,
  little-endian uint16 when the vocab fits (< 65,536 ids), else uint32;
- `NAME.idx`: little-endian int64 offsets into NAME.bin of each document's start, then the end
  (documents + 1 entries).

A shard is listed in the manifest only once both files are complete and flushed to disk, so an
interrupted `prepare` never leaves a shard that reads as valid, and a reader refuses a folder whose
`prepare` has not finished.

A shard folder may come from someone else: its manifest is read bounded (`torchpre.json_input`), each file
it names is opened inside the folder without following a symbolic link (`torchpre.confined`) and mapped
from that descriptor, and token ids are checked against the model's embedding, not the manifest's claim.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from torchpre.confined import check_name, open_file, open_replacing, write_file
from torchpre.errors import FieldError, TorchpreError, field
from torchpre.json_input import read_json

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
        """The manifest of `folder`, read as every file of a folder from others is (`json_input.read_json`: no
        symbolic link, bounded in size and depth) and every field checked: a missing one or one of the wrong type is
        an error naming the file and the key, never a crash later on."""
        path = folder / MANIFEST
        try:
            record = read_json(folder, MANIFEST, "shard_manifest")
        except FileNotFoundError:
            raise TorchpreError(
                f"{folder} is not a shard folder: it has no {MANIFEST}. "
                "Create one with `python -m torchpre.data.prepare INPUT... --output DIR`."
            ) from None
        try:
            manifest = cls._from_record(record)
        except FieldError as error:
            raise TorchpreError(f"{path} is not a valid shard manifest ({error}). Re-run prepare.") from None
        for i, shard in enumerate(manifest.shards):
            check_name(shard.name, path, f"shards[{i}].name")
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
                _largest_id(shard, f"shards[{i}]"),
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


def _largest_id(shard: object, where: str) -> int | None:
    """A shard's `max_token_id`: a token id (0 or more), or absent or null (manifests written before it was
    recorded, an empty shard)."""
    value = field(shard, "max_token_id", (int, type(None)), where, default=None)
    if value is not None and value < 0:
        raise FieldError(f"'{where}.max_token_id' is {value}, not a token id (0 or more)")
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


class DamagedShard(TorchpreError):
    """A shard file is missing, or not of the size its manifest's counts give: `prepare` writes it again."""


def shard_file_problem(folder: Path, manifest: Manifest, shard: ShardInfo) -> str | None:
    """What is wrong with `shard`'s files (missing, or sizes other than the manifest's counts), or None. A symbolic
    link in place of one, or of a folder on the way, is no damage but an UntrustedInput error."""
    try:
        map_shard(folder, manifest, manifest.shards.index(shard))
    except DamagedShard as problem:
        return str(problem)
    return None


def map_shard(folder: Path, manifest: Manifest, index: int) -> tuple[np.ndarray, np.ndarray]:
    """The tokens and document offsets of shard `index` of `manifest`, memory-mapped from descriptors opened by
    `confined.open_file` (the names the manifest gives, inside the folder, no symbolic link on the way, regular
    files) once their sizes are shown to be the manifest's counts: what is checked is what is mapped, and no file
    the manifest does not list is opened. DamagedShard for a missing file or one of another size."""
    shard, entry = manifest.shards[index], f"shards[{index}].name"
    tokens = _map(folder, f"{shard.name}.bin", entry, manifest.dtype, shard.num_tokens)
    offsets = _map(folder, f"{shard.name}.idx", entry, _OFFSET, shard.num_documents + 1)
    return tokens, offsets


def _map(folder: Path, name: str, entry: str, dtype: np.dtype, count: int) -> np.ndarray:
    path, expected = folder / name, count * dtype.itemsize
    try:
        file = open_file(folder, name, folder / MANIFEST, entry)
    except FileNotFoundError:
        raise DamagedShard(_size_problem(path, "is missing", expected, count, dtype)) from None
    with file:  # a mapping keeps the file open by itself
        size = os.fstat(file.fileno()).st_size
        if size != expected:
            raise DamagedShard(_size_problem(path, f"has {size:,} bytes", expected, count, dtype))
        return np.memmap(file, dtype=dtype, mode="r", shape=(count,)) if count else np.empty(0, dtype)


def _size_problem(path: Path, found: str, expected: int, count: int, dtype: np.dtype) -> str:
    return f"Shard file {path} {found}, but {MANIFEST} says {expected:,} bytes ({count:,} x {dtype.name})"


def out_of_vocabulary(path: Path, token_id: int, vocab_size: int, where: str) -> str:
    """The message for a token id that no row of the model's embedding holds, found in the shard file `path`
    (`where`)."""
    return (
        f"{path}: {where} token id {token_id:,}, but the model's embedding has {vocab_size:,} rows (ids 0 to "
        f"{vocab_size - 1:,}). The shard was not written by `python -m torchpre.data.prepare` with this run's "
        "tokenizer, or was altered; re-run prepare."
    )


class ShardReader:
    """Random access to the tokens of a shard folder, memory-mapped (nothing is read until used).

    `vocab_size` is the number of rows of the model's embedding, which every token id indexes: the manifest's own
    vocab_size and each shard's recorded largest id are checked against it, never trusted in its place.
    `expected_tokenizer_sha256` guards against training on ids from another tokenizer; every shard's files are
    checked against the manifest's counts, so a truncated or missing file fails here, by name, rather than as
    garbage tokens mid-run.
    """

    def __init__(
        self, folder: str | os.PathLike, vocab_size: int, expected_tokenizer_sha256: str | None = None
    ) -> None:
        self.folder = Path(folder)
        self.manifest = Manifest.read(self.folder)
        self.vocab_size = vocab_size
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
        if self.manifest.vocab_size > self.vocab_size:
            raise TorchpreError(
                f"{self.folder / MANIFEST}: vocab_size = {self.manifest.vocab_size:,}, more ids than the "
                f"{self.vocab_size:,} rows of the model's embedding (model.vocab_size, or the tokenizer's). The "
                "shards were made with another tokenizer, or the manifest was altered; re-run prepare with this "
                "run's tokenizer."
            )
        for shard in self.shards:
            if shard.max_token_id is not None and shard.max_token_id >= self.vocab_size:
                raise TorchpreError(out_of_vocabulary(self.folder / f"{shard.name}.bin", shard.max_token_id,
                                                      self.vocab_size, "its manifest records"))  # fmt: skip
        self.tokens: list[np.ndarray] = []
        self.offsets: list[np.ndarray] = []
        for index in range(len(self.shards)):
            try:
                tokens, offsets = map_shard(self.folder, self.manifest, index)
            except DamagedShard as problem:
                raise TorchpreError(
                    f"{problem}: the file is truncated or from another run. Re-run prepare for this folder."
                ) from None
            self.tokens.append(tokens)
            self.offsets.append(offsets)

    @property
    def shards(self) -> list[ShardInfo]:
        return self.manifest.shards

    def document(self, shard: int, index: int) -> np.ndarray:
        """The framed tokens of one document."""
        start, end = self.offsets[shard][index], self.offsets[shard][index + 1]
        return self.tokens[shard][start:end]
