"""Reading a checkpoint folder that someone else may have written, without running its code.

torch.distributed.checkpoint (DCP) unpickles a folder's `.metadata` with plain `pickle.load`, and its default load
planner loads every non-tensor entry with `torch.load(weights_only=False)`: either runs whatever code the file names.
Every torchpre load goes through `load` and `read_metadata` here instead:

- `.metadata` is unpickled by `MetadataUnpickler`, which resolves only DCP's metadata classes and the few torch values
  they hold (sizes, dtypes, layouts); the result must be DCP metadata of the expected shape whose every storage file is
  a bare name inside the folder (`confined_path`);
- non-tensor entries (checkpoints written before torchpre kept them in `state.json`) load with torch's
  `weights_only=True` unpickler, which builds only plain values and tensors; `checkpoint.allow_pickle` lifts that, with
  a warning naming the folder, for a foreign checkpoint that needs full pickle;
- no file is opened before the manifest vouches for it (`integrity.FileCheck`): `.metadata` and `state.json` are
  checked on their own before they are parsed, and data files are checked before they are read unless the whole
  folder was just checked.

What this does and does not protect against is in docs/security.md.
"""

import io
import logging
import pickle
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
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
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from torchpre.checkpoint.integrity import FileCheck
from torchpre.confined import confined_path
from torchpre.errors import TorchpreError, UntrustedInput

logger = logging.getLogger("torchpre")

METADATA = ".metadata"
ALLOW_PICKLE = "checkpoint.allow_pickle"

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
# Every global a `.metadata` written by torch 2.11-2.14 names, and what it resolves to. Paths (the saving folder, kept
# as StorageMeta.checkpoint_id) become pure paths, which never touch the file system.
_ALLOWED: dict[tuple[str, str], Any] = {
    (_METADATA_MODULE, cls.__name__): cls
    for cls in (
        Metadata, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata, TensorProperties, MetadataIndex,
        StorageMeta, _MEM_FORMAT_ENCODING,
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("pathlib", "PosixPath"): PurePosixPath,
    ("pathlib", "PurePosixPath"): PurePosixPath,
    ("pathlib", "WindowsPath"): PureWindowsPath,
    ("pathlib", "PureWindowsPath"): PureWindowsPath,
    ("collections", "OrderedDict"): dict,
}  # fmt: skip


class MetadataUnpickler(pickle.Unpickler):
    """Resolves `_ALLOWED` globals and torch's dtypes and layouts (pickled as `torch.float32`, ...), nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[module, name]
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)):
            return getattr(torch, name)
        raise _Refused(f"it names {module}.{name}, which a checkpoint's metadata never holds")


class _Refused(pickle.UnpicklingError):
    """A global `MetadataUnpickler` does not resolve: the file names code."""


def read_metadata(step_dir: Path, check: FileCheck) -> Metadata:
    """`step_dir`'s DCP metadata, once `check` vouches for the file, unpickled by `MetadataUnpickler` and checked;
    a TorchpreError naming the folder, the file and what was refused otherwise."""
    path = step_dir / METADATA
    check.require(METADATA)
    try:
        with open(path, "rb") as file:
            metadata = MetadataUnpickler(file).load()
    except FileNotFoundError:
        raise TorchpreError(f"{step_dir} is not a checkpoint: it has no {METADATA}.") from None
    except _Refused as error:
        raise _refused(path, str(error)) from None
    except Exception as error:  # bytes that are no pickle at all: damage, or no checkpoint
        raise TorchpreError(
            f"Cannot read the checkpoint at {step_dir} ({METADATA}: {type(error).__name__}: {error}): it is damaged "
            "or no torch.distributed.checkpoint folder. Give a complete step-N folder."
        ) from None
    _check_metadata(step_dir, path, metadata)
    return metadata


def _check_metadata(step_dir: Path, path: Path, metadata: Any) -> None:
    """Raises unless `metadata` has the types DCP writes, and every storage file is a bare name inside `step_dir`."""
    if not isinstance(metadata, Metadata):
        raise _refused(path, f"it holds a {type(metadata).__name__}, not DCP's Metadata")
    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict) or not all(
        isinstance(key, str) and isinstance(value, (TensorStorageMetadata, BytesStorageMetadata))
        for key, value in entries.items()
    ):
        raise _refused(path, "its entries are not names with tensor or bytes metadata")
    for key, value in entries.items():
        if isinstance(value, TensorStorageMetadata) and not _tensor_metadata_ok(value):
            raise _refused(path, f"the entry {key!r} has no valid dtype, size and chunks")
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise _refused(path, "its storage_data is not a mapping")
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise _refused(path, f"its storage_data holds {type(index).__name__} -> {type(info).__name__}")
        if not (_natural(info.offset) and _natural(info.length)):
            raise _refused(path, f"the entry {index.fqn!r} has offset {info.offset!r}, length {info.length!r}")
        name, entry = info.relative_path, f"storage_data[{index.fqn!r}].relative_path"
        if isinstance(name, str) and "/" in name:
            raise _refused(path, f"{entry} is {name!r}, not a bare file name")
        confined_path(step_dir, name, path, entry)


def _tensor_metadata_ok(value: TensorStorageMetadata) -> bool:
    properties, size, chunks = value.properties, value.size, value.chunks
    return (
        isinstance(properties, TensorProperties)
        and isinstance(properties.dtype, torch.dtype)
        and isinstance(size, torch.Size)
        and isinstance(chunks, list)
        and all(isinstance(chunk, ChunkStorageMetadata) for chunk in chunks)
    )


def _natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _refused(path: Path, why: str) -> UntrustedInput:
    return UntrustedInput(
        f"{path}: refused to load this checkpoint's metadata ({why}). torchpre reads a checkpoint without running "
        "code from it, and this file is not metadata that torch.distributed.checkpoint writes: it was altered or "
        "comes from an untrusted source. Load another checkpoint (docs/security.md)."
    )


class SafeReader(FileSystemReader):
    """DCP's file-system reader with `read_metadata` above, and data files checked by `check` before they are read."""

    def __init__(self, step_dir: Path, check: FileCheck) -> None:
        super().__init__(str(step_dir))
        self.step_dir, self.check = step_dir, check

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(self.step_dir, self.check)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: Any) -> Any:
        self.check.require_all(self.storage_data[item.storage_index].relative_path for item in plan.items)
        return super().read_data(plan, planner)


@contextmanager
def _refusals_unwrapped() -> Iterator[None]:
    """DCP reports what a rank raised while reading as a CheckpointException on every rank; a refusal (a
    TorchpreError: a file the manifest does not vouch for, an entry that is no plain value) is raised as itself,
    so that every rank prints its one paragraph."""
    try:
        yield
    except CheckpointException as error:
        refusals = [failure for failure, _ in error.failures.values() if isinstance(failure, TorchpreError)]
        if refusals:
            raise refusals[0] from None
        raise


def _unpickler_error(error: Exception) -> str:
    """The line of torch's weights-only unpickler error that says what it refused."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    named = [line for line in lines if "Unsupported global" in line or "WeightsUnpickler error" in line]
    return (named or lines or [type(error).__name__])[0]


class _PlainValues:
    """A load planner's `load_bytes` that loads non-tensor entries with `weights_only=True` (plain values only),
    or with full pickle when `allow_pickle`; an entry that needs more is refused by name."""

    step_dir: Path
    allow_pickle: bool

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=not self.allow_pickle)
        except pickle.UnpicklingError as error:
            raise UntrustedInput(
                f"{self.step_dir}: refused to unpickle the checkpoint entry {read_item.dest_index.fqn!r}: it is "
                f"no plain value ({_unpickler_error(error)}). torchpre's checkpoints hold none such, so this one "
                f"comes from another tool or was altered. If you trust whoever wrote it, set {ALLOW_PICKLE} = true "
                "to load it with full pickle, which runs any code it names (docs/security.md)."
            ) from None
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


class SafeLoadPlanner(_PlainValues, DefaultLoadPlanner):
    """DCP's default load planner, with `_PlainValues`."""

    def __init__(self, step_dir: Path, allow_pickle: bool) -> None:
        super().__init__()
        self.step_dir, self.allow_pickle = step_dir, allow_pickle


class WholeLoadPlanner(_PlainValues, _EmptyStateDictLoadPlanner):
    """DCP's planner that loads all a checkpoint holds into an empty state, with `_PlainValues`."""

    def __init__(self, step_dir: Path, allow_pickle: bool) -> None:
        super().__init__()
        self.step_dir, self.allow_pickle = step_dir, allow_pickle


@dataclass(frozen=True)
class Loader:
    """How this job reads checkpoints: `check` (the manifest, and the signing key when one is set) and
    `allow_pickle`."""

    check: FileCheck
    allow_pickle: bool = False

    def load(self, state: dict[str, Any], no_dist: bool = False) -> None:
        """DCP's load of `state` in place from the checked folder, through `SafeReader` and `SafeLoadPlanner`."""
        step_dir = self.check.step_dir
        if self.allow_pickle:
            logger.warning(
                "%s = true: loading %s with full pickle; a non-tensor entry in it can run code", ALLOW_PICKLE, step_dir
            )
        with warnings.catch_warnings():
            if no_dist:  # DCP warns that it loads in one process, which is what no_dist asks for
                warnings.simplefilter("ignore", UserWarning)
            with _refusals_unwrapped():
                dcp.load(
                    state,
                    storage_reader=SafeReader(step_dir, self.check),
                    planner=SafeLoadPlanner(step_dir, self.allow_pickle),
                    no_dist=no_dist,
                )

    def load_whole(self) -> dict[str, Any]:
        """All DCP entries of the checked folder, read whole in this process (no process group), nested as saved."""
        state: dict[str, Any] = {}  # filled in place, as DCP's dcp_to_torch_save does
        reader, planner = SafeReader(self.check.step_dir, self.check), WholeLoadPlanner(self.check.step_dir, False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            with _refusals_unwrapped():
                _load_state_dict(state, storage_reader=reader, planner=planner, no_dist=True)
        return state
