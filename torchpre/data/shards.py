"""Pre-tokenized token shards: the on-disk format `python -m torchpre.data.prepare` writes and training
reads a window at a time.

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

A shard is listed only once both files are complete and flushed to disk, so an interrupted `prepare` never leaves
a shard that reads as valid, and a reader refuses a folder whose `prepare` has not finished. While `prepare` runs, the
shards it writes are listed in `manifest.journal`, one JSON line each (`journal_line`), after those the manifest
lists; the manifest is written whole at the start and the end only, so that `prepare` stays linear in the number of
shards, and `Manifest.read` of an unfinished folder adds the journal's shards (a resume continues after them).

A shard folder may come from someone else: its manifest is read bounded (`torchpre.json_input`), each file
it names is opened inside the folder without following a symbolic link (`torchpre.confined`) and mapped
from that descriptor, and token ids are checked against the model's embedding, not the manifest's claim.

Training reads a folder of any number of shards with a bounded number of descriptors: the folder is resolved once and
held open, a shard's tokens file is opened (and checked) when first read, at most `MAX_OPEN_SHARDS` stay open, and
the `.idx` offsets, which windows never need, are read only by `ShardReader.document`. Tokens are read with pread
from the checked descriptor (no map: nothing counts against the kernel's maps per process, and nothing read stays
in the process's memory).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

import numpy as np

from torchpre.confined import OpenFolder, check_name, open_file, open_replacing, read_file, write_file
from torchpre.errors import FieldError, TorchpreError, json_field
from torchpre.json_input import LIMITS, JsonValue, loads, read_json

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
JOURNAL = "manifest.journal"
_OFFSET = np.dtype("<i8")
# Shards whose tokens file stays open at once, one descriptor each; the least recently read is closed first. Far below
# the smallest usual descriptor limit (1,024).
MAX_OPEN_SHARDS = 256


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
        if not manifest.complete:
            manifest.shards += _journal(folder, len(manifest.shards))
        for i, shard in enumerate(manifest.shards):
            check_name(shard.name, path, f"shards[{i}].name")
        if manifest.version != FORMAT_VERSION:
            raise TorchpreError(
                f"{path} has format version {manifest.version}; this torchpre reads version {FORMAT_VERSION}. "
                "Re-run prepare with this version."
            )
        return manifest

    @classmethod
    def _from_record(cls, record: JsonValue) -> Manifest:
        """The manifest a parsed `manifest.json` holds; a FieldError names the first field that is missing, of the
        wrong type, or (dtype, num_tokens: derived fields) at odds with the others."""
        shards = [_shard(shard, f"shards[{i}]") for i, shard in enumerate(json_field(record, "shards", list))]
        manifest = cls(
            json_field(record, "tokenizer_name", str),
            json_field(record, "tokenizer_sha256", str),
            _count(record, "vocab_size"),
            shards,
            json_field(record, "version", int),
            # Absent from manifests written before these fields existed: those were complete.
            json_field(record, "complete", bool, default=True),
            json_field(record, "source", dict, default={}),
        )
        if json_field(record, "dtype", str) != manifest.dtype.name:
            raise FieldError(
                f"'dtype' is {record['dtype']!r}, but vocab_size {manifest.vocab_size} stores tokens as "
                f"{manifest.dtype.name!r}"
            )
        if _count(record, "num_tokens") != manifest.num_tokens:
            raise FieldError(f"'num_tokens' is {record['num_tokens']}, but the shards hold {manifest.num_tokens}")
        return manifest


def _shard(record: JsonValue, where: str) -> ShardInfo:
    return ShardInfo(
        json_field(record, "name", str, where),
        _count(record, "num_tokens", where),
        _count(record, "num_documents", where),
        _largest_id(record, where),
    )


def journal_line(index: int, shard: ShardInfo) -> bytes:
    """The line of `JOURNAL` that lists `shard`, the `index`-th of its folder."""
    return (json.dumps({"index": index} | dataclasses.asdict(shard)) + "\n").encode("utf-8")


def _journal(folder: Path, listed: int) -> list[ShardInfo]:
    """The shards an unfinished `prepare` listed in `JOURNAL` after the `listed` ones of its manifest, each line read
    bounded and checked as a manifest's shard is; a last line a crash cut short (no newline) lists none."""
    path = folder / JOURNAL
    try:
        data = read_file(folder, JOURNAL, LIMITS["shard_manifest"])
    except FileNotFoundError:
        return []
    shards: list[ShardInfo] = []
    for number, line in enumerate(data.split(b"\n")[:-1], start=1):
        record, where = loads(line, path, f"line {number}"), f"line {number}"
        try:
            index, shard = _count(record, "index", where), _shard(record, where)
        except FieldError as error:
            raise TorchpreError(f"{path} is not a valid prepare journal ({error}). Re-run prepare.") from None
        if index != listed + len(shards):
            raise TorchpreError(
                f"{path}: line {number} lists shard {index}, but the shards listed before it end at "
                f"{listed + len(shards) - 1}. The journal was altered; delete the folder and re-run prepare."
            )
        check_name(shard.name, path, f"{where}.name")
        shards.append(shard)
    return shards


def _count(record: JsonValue, key: str, where: str = "") -> int:
    """A field that counts something: an integer, never negative."""
    value = json_field(record, key, int, where)
    if value < 0:
        raise FieldError(f"'{f'{where}.{key}' if where else key}' is {value}, not a count (0 or more)")
    return value


def _largest_id(shard: object, where: str) -> int | None:
    """A shard's `max_token_id`: a token id (0 or more), or absent or null (manifests written before it was
    recorded, an empty shard)."""
    value = json_field(shard, "max_token_id", (int, type(None)), where, default=None)
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
        check_shard_files(folder, manifest, manifest.shards.index(shard))
    except DamagedShard as problem:
        return str(problem)
    return None


def check_shard_files(folder: Path | OpenFolder, manifest: Manifest, index: int) -> None:
    """Opens and checks both files of shard `index` (`open_tokens`, `open_offsets`); DamagedShard if one is missing or
    of another size than the manifest's counts give."""
    open_tokens(folder, manifest, index).close()
    open_offsets(folder, manifest, index).close()


def open_tokens(folder: Path | OpenFolder, manifest: Manifest, index: int) -> BinaryIO:
    """The tokens file of shard `index` of `manifest`, opened by `confined.open_file` (the name the manifest gives,
    inside the folder, no symbolic link on the way, a regular file) and shown to be of the size the manifest's count
    gives: tokens are then read from this descriptor, so what is checked is what is read, and no file the manifest
    does not list is opened. DamagedShard for a missing file or one of another size."""
    shard = manifest.shards[index]
    return _open_checked(folder, f"{shard.name}.bin", f"shards[{index}].name", manifest.dtype, shard.num_tokens)


def open_offsets(folder: Path | OpenFolder, manifest: Manifest, index: int) -> BinaryIO:
    """The document offsets file (`.idx`) of shard `index` of `manifest`, opened and checked as `open_tokens`'s."""
    shard = manifest.shards[index]
    return _open_checked(folder, f"{shard.name}.idx", f"shards[{index}].name", _OFFSET, shard.num_documents + 1)


def _open_checked(folder: Path | OpenFolder, name: str, entry: str, dtype: np.dtype, count: int) -> BinaryIO:
    path, expected = folder / name, count * dtype.itemsize
    try:
        file = open_file(folder, name, folder / MANIFEST, entry)
    except FileNotFoundError:
        raise DamagedShard(_size_problem(path, "is missing", expected, count, dtype)) from None
    size = os.fstat(file.fileno()).st_size
    if size != expected:
        file.close()
        raise DamagedShard(_size_problem(path, f"has {size:,} bytes", expected, count, dtype))
    return file


def read_array(file: BinaryIO, path: Path, dtype: np.dtype, start: int, count: int) -> np.ndarray:
    """`count` items of `dtype` from item `start` of the checked open `file` (one pread, no file position)."""
    data = os.pread(file.fileno(), count * dtype.itemsize, start * dtype.itemsize)
    if len(data) != count * dtype.itemsize:  # the file shrank after it was checked
        raise TorchpreError(f"Shard file {path} ended early: it changed while training read it. Re-run prepare.")
    return np.frombuffer(data, dtype=dtype)


def _damaged(problem: DamagedShard) -> TorchpreError:
    return TorchpreError(f"{problem}: the file is truncated or from another run. Re-run prepare for this folder.")


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
    """Random access to the tokens of a shard folder (nothing is read until used).

    The folder is opened once; a shard's tokens file is opened and checked against the manifest's count when first
    read (`read`), and at most `MAX_OPEN_SHARDS` stay open, so a folder of any size costs a bounded number of
    descriptors and nothing per shard before training starts.

    `vocab_size` is the number of rows of the model's embedding, which every token id indexes: the manifest's own
    vocab_size and each shard's recorded largest id are checked against it, never trusted in its place.
    `expected_tokenizer_sha256` guards against training on ids from another tokenizer; a shard's file is checked
    against the manifest's counts when it is opened, so a truncated or missing file fails by name, never as garbage
    tokens.
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
        self._root = OpenFolder(self.folder)
        self._open: OrderedDict[int, BinaryIO] = OrderedDict()

    @property
    def shards(self) -> list[ShardInfo]:
        return self.manifest.shards

    def read(self, shard: int, start: int, count: int) -> np.ndarray:
        """Tokens [start, start + count) of shard `shard`, cut at its end."""
        count = max(0, min(count, self.shards[shard].num_tokens - start))
        name = self.folder / f"{self.shards[shard].name}.bin"
        return read_array(self._tokens_file(shard), name, self.manifest.dtype, start, count)

    def will_need(self, shard: int, start: int, count: int) -> None:
        """Asks the kernel to start reading tokens [start, start + count) of shard `shard` now (posix_fadvise
        WILLNEED, where the system has it), so that reads of several windows overlap instead of waiting in turn."""
        if hasattr(os, "posix_fadvise"):
            itemsize = self.manifest.dtype.itemsize
            os.posix_fadvise(self._tokens_file(shard).fileno(), start * itemsize, count * itemsize,
                             os.POSIX_FADV_WILLNEED)  # fmt: skip

    def document(self, shard: int, index: int) -> np.ndarray:
        """The framed tokens of document `index` of shard `shard` (its `.idx` is opened for this call only)."""
        if not 0 <= index < self.shards[shard].num_documents:
            raise IndexError(f"document {index} of the {self.shards[shard].num_documents} of shard {shard}")
        try:
            file = open_offsets(self._root, self.manifest, shard)
        except DamagedShard as problem:
            raise _damaged(problem) from None
        path = self.folder / f"{self.shards[shard].name}.idx"
        with file:
            start, end = read_array(file, path, _OFFSET, index, 2).tolist()
        if not 0 <= start <= end <= self.shards[shard].num_tokens:
            raise TorchpreError(
                f"{path}: document {index} runs from token {start:,} to {end:,}, outside the "
                f"{self.shards[shard].num_tokens:,} tokens {MANIFEST} gives its shard. Re-run prepare for this folder."
            )
        return self.read(shard, start, end - start)

    def _tokens_file(self, shard: int) -> BinaryIO:
        file = self._open.get(shard)
        if file is not None:
            self._open.move_to_end(shard)
            return file
        try:
            file = open_tokens(self._root, self.manifest, shard)
        except DamagedShard as problem:
            raise _damaged(problem) from None
        self._open[shard] = file
        if len(self._open) > MAX_OPEN_SHARDS:
            self._open.popitem(last=False)[1].close()
        return file
