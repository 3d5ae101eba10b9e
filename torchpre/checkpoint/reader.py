"""Reading a checkpoint folder that someone else may have written, without running its code.

torch.distributed.checkpoint (DCP) unpickles a folder's `.metadata` with plain `pickle.load`, trusts what it says, opens
the data files it names by path, and loads every tensor and non-tensor entry with `torch.load`, the non-tensor ones
with `weights_only=False`: a folder someone sends you could run code, read files outside itself, or allocate memory
without bound. Every torchpre load goes through `read_metadata`, `SafeReader` and the planners here instead:

- the metadata comes from `metadata.json` (plain data, metadata_json.py) when the manifest lists it, as for every
  torchpre save; otherwise `.metadata` is read by an interpreter of its opcodes that builds DCP's records and nothing
  else (metadata_pickle.py), or, with `checkpoint.allow_pickle` and a warning, by full pickle if it refuses. Either
  way its meaning is checked before use (metadata_checks.py): chunks tile each tensor, records lie inside their files;
- data files are opened inside the folder, never through a symbolic link (`confined.open_file`), and each tensor's
  bytes must be a zip archive of stored records as DCP writes them (torch_save.py) before torch.load reads them with
  `weights_only=True`;
- non-tensor entries (checkpoints before `state.json`) are decoded as plain values without torch.load
  (`torch_save.read_plain_value`), or with full pickle under `checkpoint.allow_pickle`, with a warning;
- no file is opened before the manifest vouches for it (`integrity.FileCheck`): the metadata and `state.json` are
  checked on their own before they are parsed, and data files before they are read unless the whole folder was
  just checked.

What this does and does not protect against is in docs/security.md.
"""

import io
import logging
import os
import pickle
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.futures import Future

from torchpre.checkpoint.integrity import MANIFEST, FileCheck, FileRecord
from torchpre.checkpoint.metadata_checks import check_metadata, refused
from torchpre.checkpoint.metadata_json import METADATA_JSON, decode
from torchpre.checkpoint.metadata_pickle import read_pickled_metadata
from torchpre.checkpoint.pickled import PlainValue, Refused
from torchpre.checkpoint.torch_save import NotAnArchive, Window, open_archive, read_plain_value
from torchpre.confined import file_kind, open_file
from torchpre.errors import TorchpreError, UntrustedInput
from torchpre.json_input import LIMITS

logger = logging.getLogger("torchpre")

METADATA = ".metadata"
ALLOW_PICKLE = "checkpoint.allow_pickle"


def read_metadata(step_dir: Path, check: FileCheck, allow_pickle: bool = False) -> Metadata:
    """`step_dir`'s DCP metadata, once `check` vouches for its file, read without unpickling (full pickle only when
    the interpreter refuses it and `allow_pickle`) and checked; a TorchpreError naming the file and what was
    refused otherwise."""
    return _read_metadata(step_dir, check, allow_pickle)[0]


def _read_metadata(step_dir: Path, check: FileCheck, allow_pickle: bool) -> tuple[Metadata, Path]:
    """The metadata and the file it was read from."""
    records = check.records()
    listed = METADATA_JSON in records if records is not None else file_kind(step_dir, METADATA_JSON) != "missing"
    name = METADATA_JSON if listed else METADATA
    source = step_dir / name
    try:
        data = check.read(name, LIMITS["metadata"])  # one open: the bytes parsed are the bytes checked
    except FileNotFoundError:
        raise TorchpreError(f"{step_dir} is not a checkpoint: it has no {METADATA}.") from None
    metadata = decode(data, source) if name == METADATA_JSON else _unpickled(data, source, allow_pickle)
    return check_metadata(metadata, source, _file_sizes(step_dir, records, source)), source


def _unpickled(data: bytes, source: Path, allow_pickle: bool) -> object:
    """A pickled `.metadata` through the interpreter; when it refuses, full pickle if `allow_pickle`."""
    try:
        return read_pickled_metadata(data, source)
    except UntrustedInput as error:
        if not allow_pickle:
            raise UntrustedInput(
                f"{error} If you trust whoever wrote it, {ALLOW_PICKLE} = true reads it with full pickle, which runs "
                "any code it names."
            ) from None
    logger.warning("%s = true: unpickling %s with full pickle, which runs any code it names", ALLOW_PICKLE, source)
    try:
        return pickle.loads(data)
    except Exception as error:  # bytes that are no pickle at all: damage, or no checkpoint
        raise TorchpreError(
            f"Cannot read the checkpoint's metadata {source} ({type(error).__name__}: {error}): it is damaged or no "
            "torch.distributed.checkpoint folder. Give a complete step-N folder."
        ) from None


def _file_sizes(step_dir: Path, records: dict[str, FileRecord] | None, source: Path) -> Callable[[str, str], int]:
    """The size of a file of `step_dir` named by `source` (at an entry): its manifest record's, or, in a folder
    without a manifest, that of the file itself opened confined."""

    def size(name: str, entry: str) -> int:
        if records is not None:
            if name not in records:
                raise refused(source, f"{entry} names {name!r}, which the folder's {MANIFEST} does not list")
            return records[name].size
        try:
            with open_file(step_dir, name, source, entry) as file:
                return os.fstat(file.fileno()).st_size
        except FileNotFoundError:
            raise TorchpreError(
                f"{source}: {entry} names {name!r}, which is missing: the checkpoint {step_dir} is incomplete. "
                "Restore the file or load another checkpoint."
            ) from None

    return size


class SafeReader(FileSystemReader):
    """DCP's file-system reader with `read_metadata` above, whose data files are checked by `check` before they are
    read, opened inside the folder without following a link, and read as `read_data` says."""

    def __init__(self, step_dir: Path, check: FileCheck, allow_pickle: bool = False) -> None:
        super().__init__(str(step_dir))
        self.step_dir, self.check, self.allow_pickle = step_dir, check, allow_pickle
        self.source = step_dir / METADATA  # the metadata file that names the data files, once read
        self.refusal: TorchpreError | None = None  # why `read_metadata` refused, which DCP reports only as text

    def read_metadata(self, *args: object, **kwargs: object) -> Metadata:
        try:
            metadata, self.source = _read_metadata(self.step_dir, self.check, self.allow_pickle)
        except TorchpreError as error:
            self.refusal = error
            raise
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP's read, file by file in the order of their bytes, with every record checked to lie inside its file
        (as its size is now, on the open descriptor) and every tensor's bytes to be an archive DCP writes."""
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        self.check.require_all(by_file)
        for name, items in sorted(by_file.items()):
            with open_file(self.step_dir, name, self.source, "storage_data relative_path") as file:
                size = os.fstat(file.fileno()).st_size
                for item in sorted(items, key=lambda item: self.storage_data[item.storage_index].offset):
                    self._read_item(item, file, size, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_item(self, item: ReadItem, file: BinaryIO, size: int, planner: LoadPlanner) -> None:
        info = self.storage_data[item.storage_index]
        end = info.offset + info.length
        where = f"{self.step_dir / info.relative_path}: the entry {item.storage_index.fqn!r} (bytes {info.offset:,} " \
                f"to {end:,})"  # fmt: skip
        if end > size:
            raise UntrustedInput(f"{where} lies past the end of the file ({size:,} bytes). {_ALTERED}")
        window = Window(file, info.offset, info.length)
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(window.read()))
            return
        tensor = _read_tensor(window, where)
        box = tuple(zip(item.storage_offsets, item.lengths))
        if tensor.dim() != len(box) or any(start + length > whole for (start, length), whole in zip(box, tensor.shape)):
            raise UntrustedInput(
                f"{where} holds a tensor of shape {tuple(tensor.shape)}, without the part (offset, length per "
                f"dimension) {box} its metadata promises. {_ALTERED}"
            )
        tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise RuntimeError(f"{where}: the load plan asks for {tuple(target.size())}, not {tuple(tensor.size())}")
        target.copy_(tensor)
        planner.commit_tensor(item, target)


_ALTERED = (
    "torch.distributed.checkpoint never writes such a file: it was altered or comes from an untrusted source. Load "
    "another checkpoint (docs/security.md)."
)


def _read_tensor(window: Window, where: str) -> torch.Tensor:
    """The tensor DCP stored in `window` (torch.save's archive), read with torch's weights-only unpickler once the
    archive is shown to be one DCP writes."""
    try:
        open_archive(window, window.length)
    except NotAnArchive as error:
        raise UntrustedInput(f"{where} is refused: {error}. {_ALTERED}") from None
    window.seek(0)
    try:
        tensor = torch.load(window, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises several types for bytes it cannot read
        raise TorchpreError(
            f"{where} cannot be read as a tensor ({type(error).__name__}: {_unpickler_error(error)}): the checkpoint "
            "is damaged or was not written by torch.distributed.checkpoint. Load another checkpoint."
        ) from None
    if not isinstance(tensor, torch.Tensor):
        raise UntrustedInput(f"{where} holds a {type(tensor).__name__}, not a tensor. {_ALTERED}")
    return tensor


@contextmanager
def _refusals_unwrapped(reader: SafeReader) -> Iterator[None]:
    """DCP reports what a rank raised while reading as a CheckpointException on every rank, and a failed read of the
    metadata as an AssertionError quoting it; a refusal (a TorchpreError: a file the manifest does not vouch for, an
    entry that is no plain value) is raised as itself, so that every rank prints its one paragraph."""
    try:
        yield
    except CheckpointException as error:
        refusals = [failure for failure, _ in error.failures.values() if isinstance(failure, TorchpreError)]
        if reader.refusal is not None or refusals:
            raise reader.refusal or refusals[0] from None
        raise
    except AssertionError:
        if reader.refusal is not None:
            raise reader.refusal from None
        raise


def _unpickler_error(error: Exception) -> str:
    """The line of torch's weights-only unpickler error that says what it refused."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    named = [line for line in lines if "Unsupported global" in line or "WeightsUnpickler error" in line]
    return (named or lines or [type(error).__name__])[0]


class _PlainValues:
    """A load planner's `load_bytes` that decodes non-tensor entries as plain values without torch.load
    (`torch_save.read_plain_value`), or with full pickle when `allow_pickle`; an entry that is no plain value is
    refused by name."""

    step_dir: Path
    allow_pickle: bool

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        loaded = torch.load(value, weights_only=False) if self.allow_pickle else self._plain(fqn, value.getvalue())
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded

    def _plain(self, fqn: str, data: bytes) -> PlainValue:
        try:
            return read_plain_value(data)
        except (NotAnArchive, Refused) as error:
            raise UntrustedInput(
                f"{self.step_dir}: refused to unpickle the checkpoint entry {fqn!r}: it is no plain value ({error}). "
                "torchpre's checkpoints hold none such, so this one comes from another tool or was altered. If you "
                f"trust whoever wrote it, set {ALLOW_PICKLE} = true to load it with full pickle, which runs any code "
                "it names (docs/security.md)."
            ) from None


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
            reader = SafeReader(step_dir, self.check, self.allow_pickle)
            with _refusals_unwrapped(reader):
                dcp.load(
                    state, storage_reader=reader, planner=SafeLoadPlanner(step_dir, self.allow_pickle), no_dist=no_dist
                )

    def load_whole(self) -> dict[str, Any]:
        """All DCP entries of the checked folder, read whole in this process (no process group), nested as saved."""
        state: dict[str, Any] = {}  # filled in place, as DCP's dcp_to_torch_save does
        reader, planner = SafeReader(self.check.step_dir, self.check), WholeLoadPlanner(self.check.step_dir, False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            with _refusals_unwrapped(reader):
                _load_state_dict(state, storage_reader=reader, planner=planner, no_dist=True)
        return state
