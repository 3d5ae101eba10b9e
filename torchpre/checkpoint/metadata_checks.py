"""What a checkpoint's DCP metadata must mean before anything is read by it, whichever file it came from (torchpre's
`metadata.json` or a pickled `.metadata`).

DCP trusts its metadata: a tensor entry whose chunks leave a gap loads "successfully" with that part of the weights
never written (uninitialised memory), a chunk without a storage record fails deep inside the load, a record past the
end of its file reads short, and a size of 2**60 elements is allocated as asked. `check_metadata` refuses all of that
by name before the metadata is used: every field has the type DCP writes, every tensor's chunks tile its shape exactly
(no gap, no overlap), every chunk and byte entry has its storage record, every record is a bare file name of the folder
and lies inside that file, holding at least the bytes its chunk needs, and sizes, ranks and byte entries are bounded.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable
from pathlib import Path, PurePath

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from torchpre.confined import check_name
from torchpre.errors import UntrustedInput

MAX_RANK = 32  # dimensions of one tensor
MAX_NUMEL = 1 << 48  # elements of one tensor: 700x the largest released model's biggest matrix
MAX_PIECES = 1 << 24  # cells of the grid the chunk boundaries cut one tensor into, for the tiling check
MAX_BYTES_ENTRY = 64 << 20  # bytes of one non-tensor entry (older checkpoints' plain values hold a few hundred)

# The dtypes a checkpoint's tensors may have, by the name DCP's pickle and torchpre's JSON give them.
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16", "complex64", "complex128", "int64", "int32", "int16", "int8",
        "uint8", "uint16", "uint32", "uint64", "bool", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
        "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)  # torch 2.11 has them all; a newer one may rename
}  # fmt: skip
MEMORY_FORMATS: dict[str, torch.memory_format] = {
    "contiguous_format": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "preserve_format": torch.preserve_format,
}


def refused(source: Path, why: str) -> UntrustedInput:
    """The error for metadata (read from the file `source`) that DCP would not have written."""
    return UntrustedInput(
        f"{source}: refused to load this checkpoint's metadata ({why}). torchpre reads a checkpoint without running "
        "code from it, and this file is not metadata that torch.distributed.checkpoint writes: it was altered or "
        "comes from an untrusted source. Load another checkpoint (docs/security.md)."
    )


def check_metadata(metadata: object, source: Path, file_size: Callable[[str, str], int]) -> Metadata:
    """`metadata` (read from `source`) once every check above holds; `file_size(name, entry)` gives the bytes of the
    folder's file `name` (named by `entry` of the metadata). Raises UntrustedInput naming `source`, the entry and what
    is wrong otherwise."""
    if not isinstance(metadata, Metadata):
        raise refused(source, f"it holds a {type(metadata).__name__}, not DCP's Metadata")
    why = _fields_problem(metadata) or _records_problem(metadata, source, file_size) or _entries_problem(metadata)
    if why:
        raise refused(source, why)
    return metadata


def _fields_problem(metadata: Metadata) -> str | None:
    if not _is(metadata.version, str, type(None)):
        return f"its version is {_kind(metadata.version)}, not a string"
    planner = metadata.planner_data
    if planner is not None and not (
        isinstance(planner, dict)
        and all(_is(key, str) and _is(path, tuple) and all(_is(part, str, int) for part in path)
                for key, path in planner.items())
    ):  # fmt: skip
        return "its planner_data is not a mapping of names to key paths"
    meta = metadata.storage_meta
    if meta is not None and not (
        _is(meta, StorageMeta)
        and (_is(meta.checkpoint_id, str, type(None)) or isinstance(meta.checkpoint_id, PurePath))
        and _is(meta.save_id, str, type(None))
        and _is(meta.load_id, str, type(None))
        and _is(meta.modules, list)
        and all(_is(module, str) for module in meta.modules)
    ):
        return "its storage_meta does not hold a checkpoint id, save and load ids and module names"
    if not _is(metadata.state_dict_metadata, dict):
        return f"its state_dict_metadata is {_kind(metadata.state_dict_metadata)}, not a mapping"
    if not _is(metadata.storage_data, dict):
        return f"its storage_data is {_kind(metadata.storage_data)}, not a mapping"
    return None


def _records_problem(metadata: Metadata, source: Path, file_size: Callable[[str, str], int]) -> str | None:
    """Every storage record: a typed index, a bare file name of the folder, a range inside that file."""
    sizes: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        if not (
            _is(index, MetadataIndex)
            and _is(index.fqn, str)
            and _is(index.offset, torch.Size, type(None))
            and _is(index.index, int, type(None))
        ):
            return f"its storage_data holds {_kind(index)} as a key, not an entry's index"
        entry = f"storage_data[{index.fqn!r}]"
        if not _is(info, _StorageInfo):
            return f"{entry} is {_kind(info)}, not a storage record"
        if info.transform_descriptors is not None:
            return f"{entry} is stored through transforms {info.transform_descriptors!r}, which torchpre does not read"
        if not (_natural(info.offset) and _natural(info.length)):
            return f"{entry} has offset {info.offset!r} and length {info.length!r}, not byte counts"
        name = check_name(info.relative_path, source, f"{entry}.relative_path")
        if "/" in name:
            return f"{entry}.relative_path is {name!r}, not a bare file name"
        if name not in sizes:
            sizes[name] = file_size(name, f"{entry}.relative_path")
        if info.offset + info.length > sizes[name]:
            return (
                f"{entry} lies at bytes {info.offset:,} to {info.offset + info.length:,} of {name}, which holds "
                f"{sizes[name]:,}"
            )
    return None


def _entries_problem(metadata: Metadata) -> str | None:
    storage = metadata.storage_data
    for fqn, entry in metadata.state_dict_metadata.items():
        if not _is(fqn, str):
            return f"its state_dict_metadata has the key {fqn!r}, not a name"
        if _is(entry, BytesStorageMetadata):
            record = storage.get(MetadataIndex(fqn))
            if record is None:
                return f"the entry {fqn!r} has no storage record"
            if record.length > MAX_BYTES_ENTRY:
                return f"the entry {fqn!r} holds {record.length:,} bytes; a non-tensor entry holds at most " \
                       f"{MAX_BYTES_ENTRY:,}"  # fmt: skip
        elif _is(entry, TensorStorageMetadata):
            why = _tensor_problem(entry, storage, fqn)
            if why:
                return f"the entry {fqn!r} {why}"
        else:
            return f"the entry {fqn!r} is {_kind(entry)}, not tensor or bytes metadata"
    return None


def _tensor_problem(entry: TensorStorageMetadata, storage: dict, fqn: str) -> str | None:
    properties, size, chunks = entry.properties, entry.size, entry.chunks
    if not (
        _is(properties, TensorProperties)
        and properties.dtype in DTYPES.values()
        and properties.layout == torch.strided
        and _is(properties.requires_grad, bool)
        and properties.memory_format in MEMORY_FORMATS.values()
        and _is(properties.pin_memory, bool)
    ):
        return f"has the properties {properties!r}, not those of a dense tensor of a known dtype"
    if not _is(size, torch.Size) or len(size) > MAX_RANK or not all(map(_natural, size)):
        return f"has the size {size!r}, not at most {MAX_RANK} dimensions of natural numbers"
    if math.prod(size) > MAX_NUMEL:
        return f"has the size {tuple(size)}: {math.prod(size):,} elements, more than the {MAX_NUMEL:,} any tensor holds"
    if not _is(chunks, list) or not all(_is(chunk, ChunkStorageMetadata) for chunk in chunks):
        return f"has the chunks {chunks!r}, not a list of chunk metadata"
    if not chunks and math.prod(size):
        return f"has the shape {tuple(size)} but no chunks: none of its elements is stored"
    for chunk in chunks:
        box = chunk.offsets, chunk.sizes
        if not all(_is(part, torch.Size) and len(part) == len(size) and all(map(_natural, part)) for part in box):
            return f"has a chunk at {chunk.offsets!r} of size {chunk.sizes!r}, not {len(size)} natural numbers each"
        if any(start + length > whole for start, length, whole in zip(*box, size)):
            return f"has a chunk at {tuple(chunk.offsets)} of size {tuple(chunk.sizes)} outside its shape {tuple(size)}"
        record = storage.get(MetadataIndex(fqn, chunk.offsets))
        if record is None:
            return f"has no storage record for its chunk at {tuple(chunk.offsets)}"
        needed = math.prod(chunk.sizes) * properties.dtype.itemsize
        if record.length < needed:
            return f"stores its chunk at {tuple(chunk.offsets)} in {record.length:,} bytes; it needs {needed:,}"
    return _tiling_problem(size, chunks)


def _tiling_problem(size: torch.Size, chunks: list[ChunkStorageMetadata]) -> str | None:
    """Why `chunks` (each inside `size`) do not cover it exactly once, or None.

    Their elements must add up to the tensor's, and they must cover every cell of the grid their boundaries cut the
    tensor into: a cell lies wholly inside or outside each chunk, so with full cover any overlap would count some
    elements twice and make the sum too large."""
    numel, held = math.prod(size), sum(math.prod(chunk.sizes) for chunk in chunks)
    if held != numel:
        return f"has chunks of {held:,} elements in all, for a shape {tuple(size)} of {numel:,}: a gap or an overlap"
    cuts = [sorted({0, whole, *(c.offsets[d] for c in chunks), *(c.offsets[d] + c.sizes[d] for c in chunks)})
            for d, whole in enumerate(size)]  # fmt: skip
    cells = math.prod(len(points) - 1 for points in cuts)
    if cells > MAX_PIECES:
        return f"has chunks that cut it into {cells:,} pieces; torchpre checks at most {MAX_PIECES:,}"
    covered = np.zeros([len(points) - 1 for points in cuts], dtype=bool)
    for chunk in chunks:
        covered[tuple(
            slice(bisect_left(points, start), bisect_left(points, start + length))
            for points, start, length in zip(cuts, chunk.offsets, chunk.sizes)
        )] = True  # fmt: skip
    if not covered.all():
        return f"has chunks that leave a gap in its shape {tuple(size)} and overlap elsewhere"
    return None


def _is(value: object, *kinds: type) -> bool:
    """Whether `value`'s type is one of `kinds` exactly (a bool is no int, a subclass no dataclass of DCP's)."""
    return type(value) in kinds


def _natural(value: object) -> bool:
    return type(value) is int and value >= 0


def _kind(value: object) -> str:
    return "None" if value is None else f"a {type(value).__name__}"
