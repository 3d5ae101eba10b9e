"""A pickled DCP `.metadata` (another tool's checkpoint, or torchpre's from before `metadata.json`), read by the
opcode interpreter (pickled.py) with `METADATA`: the grammar of exactly what torch 2.11-2.14's DCP pickles.

Disassembled, such a file names DCP's metadata dataclasses (each made by NEWOBJ and given its fields by one BUILD;
TensorProperties's fields come as the tuple of its `__getstate__`), `torch.Size` of a tuple of ints, dtypes as
`torch.<name>` constants, `torch.serialization._get_layout('torch.strided')`, `_MEM_FORMAT_ENCODING(<int>)`, and the
saving folder as a `pathlib` path; older writers also an empty `collections.OrderedDict`. Each of these is a `Global`
below whose call or record checks its arguments and fields; paths become pure paths, which never touch the file
system. Nothing else is read, and nothing the file names is ever called: the records are built by their dataclass
constructors from checked values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path, PurePath, PurePosixPath, PureWindowsPath

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from torchpre.checkpoint.metadata_checks import DTYPES, MAX_RANK, refused
from torchpre.checkpoint.pickled import (
    OBJECT_OPCODES,
    PLAIN_OPCODES,
    Global,
    Grammar,
    Item,
    NotAPickle,
    Record,
    Refused,
    interpret,
)
from torchpre.errors import TorchpreError

_MODULE = "torch.distributed.checkpoint.metadata"
_NONE = type(None)
_INT64 = range(-(1 << 63), 1 << 63)
MAX_PATH_PARTS = 4096
_FORMATS = {
    _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT: torch.contiguous_format,
    _MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST: torch.channels_last,
    _MEM_FORMAT_ENCODING.TORCH_PRESERVE_FORMAT: torch.preserve_format,
}


def _fields(cls: type, kinds: dict[str, tuple[type, ...]]) -> Record:
    """The record of the dataclass `cls`, whose BUILD state is a mapping of some of its fields (`kinds`: the
    types each may hold), every field without a default among them."""
    required = {
        f.name for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }  # fmt: skip

    def build(state: Item) -> object:
        if type(state) is not dict:
            raise Refused(f"its state is a {type(state).__name__}, not a mapping of its fields")
        for name, value in state.items():
            if name not in kinds:
                raise Refused(f"it has no field {name!r}")
            if type(value) not in kinds[name]:
                raise Refused(f"its field {name!r} holds a {type(value).__name__}")
        missing = sorted(required - set(state))
        if missing:
            raise Refused(f"it lacks the field {missing[0]!r}")
        return cls(**state)

    return Record(cls, build, tuple(kinds))


def _tensor_properties(state: Item) -> TensorProperties:
    """TensorProperties from the state its `__getstate__` gives: (dtype, layout, requires_grad, memory format's
    encoding, pin_memory)."""
    kinds = (torch.dtype, torch.layout, bool, _MEM_FORMAT_ENCODING, bool)
    if type(state) is not tuple or len(state) != 5 or any(type(v) is not k for v, k in zip(state, kinds)):
        raise Refused(f"its state is {state!r}, not (dtype, layout, requires_grad, memory format, pin_memory)")
    dtype, layout, requires_grad, encoding, pin_memory = state
    return TensorProperties(dtype, layout, requires_grad, _FORMATS[encoding], pin_memory)


def _size(args: tuple[Item, ...]) -> torch.Size:
    if len(args) != 1 or type(args[0]) is not tuple or len(args[0]) > MAX_RANK:
        raise Refused(f"a size is one tuple of at most {MAX_RANK} integers")
    if not all(type(value) is int and value in _INT64 for value in args[0]):
        raise Refused("a size holds 64-bit integers only")
    return torch.Size(args[0])


def _layout(args: tuple[Item, ...]) -> torch.layout:
    if args != ("torch.strided",):
        raise Refused("a checkpoint's tensors are strided")
    return torch.strided


def _memory_format(args: tuple[Item, ...]) -> _MEM_FORMAT_ENCODING:
    if len(args) != 1 or type(args[0]) is not int or args[0] not in {member.value for member in _FORMATS}:
        raise Refused(f"the encodings are {sorted(member.value for member in _FORMATS)}")
    return _MEM_FORMAT_ENCODING(args[0])


def _pure(kind: type[PurePosixPath] | type[PureWindowsPath]) -> Callable[[tuple[Item, ...]], PurePath]:
    def path(args: tuple[Item, ...]) -> PurePath:
        if len(args) > MAX_PATH_PARTS or not all(type(part) is str for part in args):
            raise Refused(f"a path is made of at most {MAX_PATH_PARTS} strings")
        return kind(*args)

    return path


def _empty_mapping(args: tuple[Item, ...]) -> dict:
    if args != ():
        raise Refused("only an empty mapping is made this way")
    return {}


_RECORDS = {
    Metadata: _fields(Metadata, {
        "state_dict_metadata": (dict,), "planner_data": (dict, _NONE), "storage_data": (dict, _NONE),
        "storage_meta": (StorageMeta, _NONE), "version": (str, _NONE),
    }),
    TensorStorageMetadata: _fields(
        TensorStorageMetadata, {"properties": (TensorProperties,), "size": (torch.Size,), "chunks": (list,)}
    ),
    ChunkStorageMetadata: _fields(ChunkStorageMetadata, {"offsets": (torch.Size,), "sizes": (torch.Size,)}),
    BytesStorageMetadata: Record(BytesStorageMetadata, lambda _: BytesStorageMetadata()),
    TensorProperties: Record(TensorProperties, _tensor_properties, ("dtype", "layout", "requires_grad",
                                                                    "memory_format", "pin_memory")),
    MetadataIndex: _fields(MetadataIndex, {"fqn": (str,), "offset": (torch.Size, _NONE), "index": (int, _NONE)}),
    StorageMeta: _fields(StorageMeta, {
        "checkpoint_id": (str, PurePosixPath, PureWindowsPath, _NONE), "save_id": (str, _NONE),
        "load_id": (str, _NONE), "modules": (list,),
    }),
    _StorageInfo: _fields(_StorageInfo, {
        "relative_path": (str,), "offset": (int,), "length": (int,), "transform_descriptors": (_NONE,),
    }),
}  # fmt: skip

_CALLS = {
    ("torch", "Size"): _size,
    ("torch.serialization", "_get_layout"): _layout,
    (_MODULE, "_MEM_FORMAT_ENCODING"): _memory_format,
    ("collections", "OrderedDict"): _empty_mapping,
} | {
    (module, name): _pure(PureWindowsPath if "Windows" in name else PurePosixPath)
    for module in ("pathlib", "pathlib._local")  # Python 3.13 moved the classes
    for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")
}

GLOBALS: dict[tuple[str, str], Global] = (
    {(cls.__module__, cls.__name__): Global(cls.__module__, cls.__name__, record=record)
     for cls, record in _RECORDS.items()}
    | {key: Global(*key, call=call) for key, call in _CALLS.items()}
    | {("torch", name): Global("torch", name, value=dtype) for name, dtype in DTYPES.items()}
)  # fmt: skip

METADATA = Grammar(
    "a checkpoint's metadata",
    (PLAIN_OPCODES - {"BINFLOAT", "SHORT_BINBYTES", "BINBYTES"}) | OBJECT_OPCODES,
    GLOBALS,
    immutable=(torch.Size, torch.dtype, torch.layout, _MEM_FORMAT_ENCODING, PurePosixPath, PureWindowsPath),
)


def read_pickled_metadata(data: bytes, source: Path) -> Item:
    """What the pickled metadata `data` (the file `source`) holds, built by the interpreter under `METADATA`; an
    UntrustedInput naming `source`, the opcode and what it refused otherwise (a TorchpreError for bytes that are no
    pickle: damage). Whether it is DCP's Metadata, and means what DCP writes, is for `check_metadata`."""
    try:
        return interpret(data, METADATA)
    except NotAPickle as error:
        raise TorchpreError(
            f"Cannot read the checkpoint at {source.parent} ({source.name}: {error}): it is damaged or no "
            "torch.distributed.checkpoint folder. Give a complete step-N folder."
        ) from None
    except Refused as error:
        raise refused(source, str(error)) from None
