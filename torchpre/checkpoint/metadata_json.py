"""DCP's metadata as plain data: `metadata.json`, which every torchpre save writes beside DCP's pickled `.metadata`
(kept for other tools) and every load reads instead of it when the manifest lists it, so that loading a torchpre
checkpoint unpickles nothing at all.

The file mirrors DCP's `Metadata` field for field, under DCP's names:

    {"version": "1.0.0",
     "state_dict_metadata": {name: {"type": "bytes"}
                             | {"type": "tensor", "dtype": "float32", "size": [...], "requires_grad": false,
                                "memory_format": "contiguous_format", "pin_memory": false,
                                "chunks": [{"offsets": [...], "sizes": [...]}, ...]}},
     "planner_data": {name: [key, ...]} | null,
     "storage_data": [{"index": {"fqn": name, "offset": [...] | null, "index": int | null},
                       "relative_path": file, "offset": bytes, "length": bytes}, ...],
     "storage_meta": {"checkpoint_id": {"posix_path": ...} | {"windows_path": ...} | string | null,
                      "save_id": ..., "load_id": ..., "modules": [...]} | null}

`decode` builds the records from typed fields (a path becomes a pure path); what they mean is checked by
`metadata_checks.check_metadata`, as for a pickled `.metadata`.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePath, PurePosixPath, PureWindowsPath
from typing import TypeVar

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

from torchpre.checkpoint.metadata_checks import DTYPES, MAX_RANK, MEMORY_FORMATS, refused
from torchpre.errors import FieldError, Kinds, json_field
from torchpre.json_input import JsonValue, loads

METADATA_JSON = "metadata.json"
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_FORMAT_NAMES = {memory_format: name for name, memory_format in MEMORY_FORMATS.items()}
_PATHS = {"posix_path": PurePosixPath, "windows_path": PureWindowsPath}
_INT64 = range(-(1 << 63), 1 << 63)
FieldValue = TypeVar("FieldValue")


def encode(metadata: Metadata) -> bytes:
    """`metadata`, as DCP's writer completed it, as `metadata.json`'s bytes."""
    record = {
        "version": metadata.version,
        "state_dict_metadata": {fqn: _entry(value) for fqn, value in metadata.state_dict_metadata.items()},
        "planner_data": None if metadata.planner_data is None else {
            fqn: list(path) for fqn, path in metadata.planner_data.items()
        },
        "storage_data": [_storage(index, info) for index, info in metadata.storage_data.items()],
        "storage_meta": None if metadata.storage_meta is None else _storage_meta(metadata.storage_meta),
    }  # fmt: skip
    return json.dumps(record, separators=(",", ":")).encode("utf-8")


def _entry(value: TensorStorageMetadata | BytesStorageMetadata) -> dict[str, object]:
    if isinstance(value, BytesStorageMetadata):
        return {"type": "bytes"}
    properties = value.properties
    if properties.layout != torch.strided:
        raise ValueError(f"DCP saved a tensor of layout {properties.layout}; torchpre saves strided tensors only")
    return {
        "type": "tensor",
        "dtype": _DTYPE_NAMES[properties.dtype],
        "size": list(value.size),
        "requires_grad": properties.requires_grad,
        "memory_format": _FORMAT_NAMES[properties.memory_format],
        "pin_memory": properties.pin_memory,
        "chunks": [{"offsets": list(chunk.offsets), "sizes": list(chunk.sizes)} for chunk in value.chunks],
    }


def _storage(index: MetadataIndex, info: _StorageInfo) -> dict[str, object]:
    if info.transform_descriptors:
        raise ValueError(f"DCP stored {index.fqn!r} through transforms; torchpre writes without any")
    offset = None if index.offset is None else list(index.offset)
    return {
        "index": {"fqn": index.fqn, "offset": offset, "index": index.index},
        "relative_path": info.relative_path,
        "offset": info.offset,
        "length": info.length,
    }


def _storage_meta(meta: StorageMeta) -> dict[str, object]:
    checkpoint_id = meta.checkpoint_id
    if isinstance(checkpoint_id, PurePath):
        kind = "windows_path" if isinstance(checkpoint_id, PureWindowsPath) else "posix_path"
        checkpoint_id = {kind: str(checkpoint_id)}
    return {"checkpoint_id": checkpoint_id, "save_id": meta.save_id, "load_id": meta.load_id,
            "modules": list(meta.modules)}  # fmt: skip


def decode(data: bytes, source: Path) -> Metadata:
    """The Metadata `data` (the bytes of `source`, a `metadata.json`) describes; an UntrustedInput naming `source`
    and the field when a field is missing or of the wrong type."""
    record = loads(data, source)
    try:
        entries = json_field(record, "state_dict_metadata", dict)
        planner = _optional(record, "planner_data", dict)
        return Metadata(
            state_dict_metadata={fqn: _read_entry(entries, fqn) for fqn in entries},
            planner_data=None if planner is None else {fqn: _key_path(planner, fqn) for fqn in planner},
            storage_data=_read_storage_data(json_field(record, "storage_data", list)),
            storage_meta=_read_storage_meta(_optional(record, "storage_meta", dict)),
            version=_optional(record, "version", str),
        )  # fmt: skip
    except FieldError as error:
        raise refused(source, str(error)) from None


def _optional(record: dict[str, JsonValue], key: str, kinds: Kinds[FieldValue], where: str = "") -> FieldValue | None:
    """`record[key]`, None when it is null or absent, else one of `kinds`."""
    return None if record.get(key) is None else json_field(record, key, kinds, where)


def _read_entry(entries: dict[str, JsonValue], fqn: str) -> TensorStorageMetadata | BytesStorageMetadata:
    where = f"state_dict_metadata.{fqn}"
    entry = json_field(entries, fqn, dict, "state_dict_metadata")
    kind = json_field(entry, "type", str, where)
    if kind == "bytes":
        return BytesStorageMetadata()
    if kind != "tensor":
        raise FieldError(f"'{where}.type' is {kind!r}, not 'tensor' or 'bytes'")
    dtype, memory_format = json_field(entry, "dtype", str, where), json_field(entry, "memory_format", str, where)
    if dtype not in DTYPES or memory_format not in MEMORY_FORMATS:
        raise FieldError(f"'{where}' has the dtype {dtype!r} and memory format {memory_format!r}: not one of "
                         f"{sorted(DTYPES)} and {sorted(MEMORY_FORMATS)}")  # fmt: skip
    properties = TensorProperties(
        dtype=DTYPES[dtype],
        layout=torch.strided,
        requires_grad=json_field(entry, "requires_grad", bool, where),
        memory_format=MEMORY_FORMATS[memory_format],
        pin_memory=json_field(entry, "pin_memory", bool, where),
    )
    chunks = [_chunk(chunk, f"{where}.chunks[{n}]") for n, chunk in enumerate(json_field(entry, "chunks", list, where))]
    return TensorStorageMetadata(properties, _size(entry, "size", where), chunks)


def _chunk(chunk: JsonValue, where: str) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(_size(chunk, "offsets", where), _size(chunk, "sizes", where))


def _size(record: JsonValue, key: str, where: str) -> torch.Size:
    values = json_field(record, key, list, where)
    if len(values) > MAX_RANK or not all(type(value) is int and value in _INT64 for value in values):
        raise FieldError(f"'{where}.{key}' is not a list of at most {MAX_RANK} 64-bit integers")
    return torch.Size(values)


def _key_path(planner: dict[str, JsonValue], fqn: str) -> tuple[str | int, ...]:
    path = json_field(planner, fqn, list, "planner_data")
    if not all(type(part) in (str, int) for part in path):
        raise FieldError(f"'planner_data.{fqn}' holds something other than names and indices")
    return tuple(path)


def _read_storage_data(items: list[JsonValue]) -> dict[MetadataIndex, _StorageInfo]:
    storage = {}
    for n, item in enumerate(items):
        where = f"storage_data[{n}]"
        index = json_field(item, "index", dict, where)
        offset = None if index.get("offset") is None else _size(index, "offset", f"{where}.index")
        key = MetadataIndex(json_field(index, "fqn", str, f"{where}.index"), offset,
                            _optional(index, "index", int, f"{where}.index"))  # fmt: skip
        if key in storage:
            raise FieldError(f"'{where}' stores {key.fqn!r} at {offset} a second time")
        storage[key] = _StorageInfo(json_field(item, "relative_path", str, where),
                                    json_field(item, "offset", int, where),
                                    json_field(item, "length", int, where))  # fmt: skip
    return storage


def _read_storage_meta(meta: dict[str, JsonValue] | None) -> StorageMeta | None:
    if meta is None:
        return None
    checkpoint_id = _optional(meta, "checkpoint_id", (str, dict), "storage_meta")
    if isinstance(checkpoint_id, dict):
        if len(checkpoint_id) != 1 or next(iter(checkpoint_id)) not in _PATHS:
            raise FieldError(f"'storage_meta.checkpoint_id' is not one of {sorted(_PATHS)}")
        kind = next(iter(checkpoint_id))
        checkpoint_id = _PATHS[kind](json_field(checkpoint_id, kind, str, "storage_meta.checkpoint_id"))
    modules = json_field(meta, "modules", list, "storage_meta")
    if not all(type(module) is str for module in modules):
        raise FieldError("'storage_meta.modules' holds something other than names")
    return StorageMeta(checkpoint_id, _optional(meta, "save_id", str, "storage_meta"),
                       _optional(meta, "load_id", str, "storage_meta"), modules)  # fmt: skip
