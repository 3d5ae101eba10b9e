"""The file of one rank's in-memory snapshot (checkpoint.memory_interval): its whole training state at one step, as
raw tensor bytes in one file, with the manifest of those bytes and a checksum of everything.

    magic (8 bytes) | header length (8, little-endian) | header (JSON, padded) | payload | digest

The header is the manifest: the run id, the step, the rank and world size, the layout, every tensor as [name, dtype,
shape, offset, bytes] into the payload, and the non-tensor values (state.json's, by flattened name). The digest is
the CRC-32 of all that precedes it, or its HMAC-SHA256 under checkpoint.signing_key_file. The header is padded so that
the payload starts on a 64-byte boundary, where each tensor's bytes can be viewed in their dtype.

A snapshot lies in a folder anyone on the node may write (/dev/shm), so reading one trusts nothing in it: the digest
is checked first, then every header field against what this rank expects (`Expected`, computed from its live state,
so a snapshot of another run, step, rank, layout or model is refused), then every value against its rule. Nothing is
unpickled, and no name or size from the file picks what is read: the live state's entries do.
"""

import hashlib
import hmac
import json
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchpre.checkpoint.values import check_values
from torchpre.errors import UntrustedInput
from torchpre.json_input import loads

MAGIC = b"TPSNAP01"
PREFIX = len(MAGIC) + 8
ALIGN = 64
HEADER_LIMIT = 64 << 20  # the values and the manifest of a rank's state; a 405B rank's is a few MiB
Entry = tuple[str, str, tuple[int, ...], int, int]  # name, dtype, shape, offset in the payload, bytes


class SnapshotError(Exception):
    """A snapshot that must not be used: torn, altered, or another run's, step's, rank's or layout's. The message
    names the file and what is wrong; the restart falls back (to a peer's replica, or to the disk checkpoint)."""


@dataclass(frozen=True)
class Expected:
    """What a snapshot must be for this rank to use it: all of it fixed by the run and this rank's live state."""

    run: str
    step: int
    rank: int
    world_size: int
    layout: Mapping[str, Any]
    entries: tuple[Entry, ...]
    signing_key: bytes | None = None

    @property
    def digest_name(self) -> str:
        return "hmac-sha256" if self.signing_key is not None else "crc32"

    @property
    def payload_bytes(self) -> int:
        return payload_bytes(self.entries)

    @property
    def size_limit(self) -> int:
        """The most bytes a valid snapshot of this rank can have."""
        return PREFIX + HEADER_LIMIT + self.payload_bytes + digest_size(self.signing_key)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of `tensor` (a DTensor's local shard): what a snapshot saves and loads into."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def entries_of(tensors: Mapping[str, torch.Tensor]) -> tuple[Entry, ...]:
    """The payload's manifest for `tensors` (flattened names, live tensors): each local tensor's bytes, in order,
    at offsets aligned to 64 bytes."""
    entries, offset = [], 0
    for name, tensor in tensors.items():
        held = local(tensor)
        size = held.numel() * held.element_size()
        entries.append((name, str(held.dtype).removeprefix("torch."), tuple(held.shape), offset, size))
        offset += -(-size // ALIGN) * ALIGN
    return tuple(entries)


def payload_bytes(entries: tuple[Entry, ...]) -> int:
    return max((offset + -(-size // ALIGN) * ALIGN for _, _, _, offset, size in entries), default=0)


def digest_size(signing_key: bytes | None) -> int:
    return 32 if signing_key is not None else 4


def encode_prefix(expected: Expected, values: Mapping[str, Any]) -> bytes:
    """The magic, the header's length and the header of a snapshot of `expected` holding `values`: what precedes
    the payload, padded so that the payload starts aligned."""
    header = {
        "run": expected.run, "step": expected.step, "rank": expected.rank, "world_size": expected.world_size,
        "layout": dict(expected.layout), "entries": [list(entry) for entry in expected.entries],
        "values": dict(values), "payload_bytes": expected.payload_bytes, "digest": expected.digest_name,
    }  # fmt: skip
    text = json.dumps(header, sort_keys=True).encode("utf-8")
    text += b" " * (-(PREFIX + len(text)) % ALIGN)
    return MAGIC + len(text).to_bytes(8, "little") + text


class Digest:
    """The running digest of a snapshot's bytes: CRC-32, or HMAC-SHA256 under `signing_key`."""

    def __init__(self, signing_key: bytes | None):
        self._hmac = hmac.new(signing_key, digestmod=hashlib.sha256) if signing_key is not None else None
        self._crc = 0

    def update(self, data: bytes | memoryview) -> None:
        if self._hmac is not None:
            self._hmac.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def value(self) -> bytes:
        return self._hmac.digest() if self._hmac is not None else self._crc.to_bytes(4, "little")


def verify(data: bytearray, expected: Expected, path: Path) -> tuple[dict[str, Any], memoryview]:
    """The values and the payload of the snapshot `data` (the bytes of the file `path`), once its digest, every
    header field and every value are shown to be what `expected` says; a SnapshotError naming `path` otherwise."""
    size = digest_size(expected.signing_key)
    if len(data) < PREFIX + size or data[: len(MAGIC)] != MAGIC:
        raise SnapshotError(f"{path} is no torchpre snapshot ({len(data)} bytes, another start)")
    digest = Digest(expected.signing_key)
    body = memoryview(data)[: len(data) - size]
    digest.update(body)
    if not hmac.compare_digest(digest.value(), bytes(data[len(data) - size :])):
        raise SnapshotError(f"{path}: its {expected.digest_name} does not match its bytes (torn or altered)")
    header_length = int.from_bytes(data[len(MAGIC) : PREFIX], "little")
    if header_length > min(HEADER_LIMIT, len(body) - PREFIX):
        raise SnapshotError(f"{path}: a header of {header_length:,} bytes, beyond the file or the limit")
    try:
        header = loads(bytes(data[PREFIX : PREFIX + header_length]), path, "header")
    except UntrustedInput as error:
        raise SnapshotError(str(error)) from None
    payload = body[PREFIX + header_length :]
    _require_header(header, expected, len(payload), path)
    try:
        check_values(header["values"], path)
    except UntrustedInput as error:
        raise SnapshotError(str(error)) from None
    if header["values"].get("train.step") != expected.step:
        raise SnapshotError(f"{path}: 'train.step' is not the snapshot's step {expected.step}")
    return header["values"], payload


def _require_header(header: Any, expected: Expected, payload: int, path: Path) -> None:
    if not isinstance(header, dict):
        raise SnapshotError(f"{path}: its header is a JSON {type(header).__name__}, not an object")
    wanted = _as_json({
        "run": expected.run, "step": expected.step, "rank": expected.rank, "world_size": expected.world_size,
        "layout": dict(expected.layout), "entries": [list(entry) for entry in expected.entries],
        "payload_bytes": payload, "digest": expected.digest_name,
    })  # fmt: skip
    for key, value in wanted.items():
        if header.get(key) != value:
            if key == "entries":
                raise SnapshotError(f"{path}: its tensors are not those this rank holds (another model or layout)")
            raise SnapshotError(f"{path}: its {key} is {repr(header.get(key))[:80]}, not {str(value)[:80]}")
    if not isinstance(header.get("values"), dict) or set(header) != {*wanted, "values"}:
        raise SnapshotError(f"{path}: its header holds other fields than a torchpre snapshot's")


def _as_json(value: Any) -> Any:
    """`value` as it reads back from JSON (tuples become lists)."""
    return json.loads(json.dumps(value))


def tensor_at(payload: memoryview, entry: Entry) -> torch.Tensor:
    """The tensor `entry` describes, a view of `payload` (writable memory, 64-byte aligned offsets)."""
    _, dtype, shape, offset, size = entry
    raw = torch.frombuffer(payload, dtype=torch.uint8, count=size, offset=offset) if size else torch.empty(0)
    return raw.view(getattr(torch, dtype)).view(shape)


def snapshot_name(rank: int, step: int, kind: str) -> str:
    """The file name of `rank`'s snapshot of `step`: kind "own" (written by the rank) or "replica" (by its peer)."""
    return f"rank{rank}-step{step}.{kind}"


def parse_name(name: str) -> tuple[int, int] | None:
    """The rank and step a snapshot file's name says; None for any other name (a temporary file among them)."""
    match = _NAME.fullmatch(name)
    return (int(match[1]), int(match[2])) if match else None


_NAME = re.compile(r"rank(\d{1,9})-step(\d{1,12})\.(own|replica)")
