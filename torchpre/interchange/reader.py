"""A Hugging Face safetensors folder, read one box of one tensor at a time.

The folder is `config.json` plus `model.safetensors`, or numbered files and `model.safetensors.index.json`, whose
`weight_map` names each tensor's file. The folder is someone else's: every file of it is opened through
`torchpre.confined.open_file` (no symbolic link on any component of its name, a regular file, a name from the index
inside the folder; in a huggingface_hub cache snapshot, the blob a file's link names: `confined.located`), the JSON
files are bounded in size and depth (`torchpre.json_input`), and only the files the index names are read. Only the
safetensors files' headers are read up front (names, shapes, dtypes); `read(name, box)` then reads the bytes of that
box through safetensors' `safe_open` slices, which map the file and copy nothing until the box is used. A block-FP8
folder (DeepSeek-V3 as released: `quantization_config` with quant_method 'fp8' and a `weight_block_size`) stores each
linear weight in float8_e4m3fn with a float32 `weight_scale_inv` per block: `read` dequantizes the box it reads (its
FP8 values times their blocks' scales, in bfloat16, the dtype the released models trained in), so no rank needs a
whole weight to dequantize its shard. Nothing is unpickled; safetensors holds only tensors.

A file stays mapped only while `reading()` is open: the pages a read touched leave the process when it closes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

import torch
from safetensors import safe_open
from torch import Tensor

from torchpre.confined import check_name, file_kind, located, open_file
from torchpre.errors import FieldError, TorchpreError, json_field
from torchpre.json_input import JsonValue, read_json
from torchpre.models.hf_fields import IRRELEVANT_KINDS, check_kinds
from torchpre.models.hf_sources import Box

CONFIG = "config.json"
SAFETENSORS = "model.safetensors"
INDEX = "model.safetensors.index.json"
SCALE_SUFFIX = "_scale_inv"  # DeepSeek-V3's block-FP8 scales: `<weight name>_scale_inv`

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor is stored (`file`, a name inside `folder`) and as what."""

    folder: Path
    file: str
    shape: torch.Size
    dtype: torch.dtype

    @property
    def path(self) -> Path:
        return self.folder / self.file


def is_hf_folder(path: Path) -> bool:
    """A folder with a config.json and safetensors weights (one file, or an index), as `save_pretrained` writes. A
    symbolic link in place of one of them counts as the file: reading the folder then refuses it by name."""

    def present(name: str) -> bool:
        return file_kind(path, name) != "missing"

    return present(CONFIG) and (present(SAFETENSORS) or present(INDEX))


def read_config(folder: Path) -> dict[str, JsonValue]:
    """The folder's config.json, which must hold a JSON object (read confined and bounded: `read_json`)."""
    if not folder.is_dir():
        raise TorchpreError(
            f"Hugging Face folder {folder} does not exist. Give a folder holding config.json and model.safetensors."
        )
    try:
        config = read_json(*located(folder, CONFIG), "config")
    except FileNotFoundError:
        raise TorchpreError(f"{folder / CONFIG} does not exist.") from None
    if not isinstance(config, dict):
        raise TorchpreError(f"{folder / CONFIG} holds a JSON {type(config).__name__}, not a config object.")
    return config


class HFFolder:
    """A folder's tensors by name (`shapes`, `dtype`), each box of one read on demand (`read`, inside `reading()`);
    `bytes_read` counts the stored bytes read so far. FP8 scales are not tensors of their own here: a weight with
    one reads dequantized, as bfloat16."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.config = read_config(folder)
        self.block = _fp8_block(self.config, folder)
        stored = _stored_tensors(folder)
        self.scales = {name.removesuffix(SCALE_SUFFIX): stored.pop(name) for name in list(stored) if _is_scale(name)}
        if self.scales and self.block is None:
            raise TorchpreError(
                f"{folder}: {next(iter(self.scales))}{SCALE_SUFFIX} is an FP8 scale, but config.json has no "
                "quantization_config saying how the weights are quantized."
            )
        for weight, scale in self.scales.items():
            if weight not in stored:
                raise TorchpreError(f"{folder}: {weight}{SCALE_SUFFIX} has no weight {weight} to scale.")
            _check_scale_shape(weight, stored[weight], scale, self.block)
        self.stored = stored
        self.bytes_read = 0
        self._open: dict[str, _Safetensors] | None = None

    @property
    def shapes(self) -> dict[str, torch.Size]:
        return {name: tensor.shape for name, tensor in self.stored.items()}

    def dtype(self, name: str) -> torch.dtype:
        """The dtype `read` returns: the stored one, bfloat16 for a block-FP8 weight."""
        return torch.bfloat16 if name in self.scales else self.stored[name].dtype

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Keeps the files `read` opens mapped until the block ends; the tensors read must not outlive it unless
        copied (they are views of the mapping)."""
        self._open = {}
        try:
            yield
        finally:
            for opened in self._open.values():
                opened.close()
            self._open = None

    def read(self, name: str, box: Box) -> Tensor:
        """The box of tensor `name` (missing or open slices: whole dimensions), dequantized if it is block-FP8."""
        stored = self.stored[name]
        whole = (*box, *[slice(None)] * (len(stored.shape) - len(box)))
        box = tuple(slice(*part.indices(size)[:2]) for part, size in zip(whole, stored.shape))
        value = self._slice(stored, name, box)
        if name not in self.scales:
            return value
        rows, columns = box
        (height, width), scale = self.block, self.scales[name]
        first_row, first_column = rows.start // height, columns.start // width
        scale_box = (slice(first_row, -(-rows.stop // height)), slice(first_column, -(-columns.stop // width)))
        blocks = self._slice(scale, name + SCALE_SUFFIX, scale_box).float()
        # Each row and column of the box picks its block's scale: memory of the box's size, whatever the block
        # size the config claims (repeating each scale over a whole block could allocate without bound).
        row_blocks = torch.arange(rows.start, rows.stop) // height - first_row
        column_blocks = torch.arange(columns.start, columns.stop) // width - first_column
        blocks = blocks[row_blocks][:, column_blocks]
        return (value.float() * blocks).to(torch.bfloat16)

    def _slice(self, stored: StoredTensor, name: str, box: Box) -> Tensor:
        if self._open is None:
            raise RuntimeError("HFFolder.read outside `with folder.reading():`")
        if stored.file not in self._open:
            self._open[stored.file] = _Safetensors.open(self.folder, stored.file)
        value = self._open[stored.file].handle.get_slice(name)[box]
        self.bytes_read += value.numel() * value.element_size()
        return value


@dataclass(frozen=True)
class _Safetensors:
    """A safetensors file of the folder, opened confined (`file`), and safetensors' handle on that very file."""

    file: BinaryIO
    handle: safe_open

    @classmethod
    def open(cls, folder: Path, name: str, index: Path | None = None) -> _Safetensors:
        """`folder/name` (named by the index file `index`, if any) opened by `confined.open_file`, then handed to
        safetensors as the descriptor's own file (`/proc/self/fd/N`; `/dev/fd/N` off Linux): safetensors opens by
        name, and a name of the folder could be swapped for a symbolic link between our check and its open, while
        the descriptor's file is the one checked. The descriptor stays open as long as the handle. Whatever
        safetensors refuses (a damaged or hostile header, offsets past the end) is an error naming the file."""
        path = folder / name
        try:
            file = open_file(*located(folder, name), index, f"weight_map (file {name!r})" if index else "")
        except FileNotFoundError:
            raise TorchpreError(
                f"{path} does not exist (only safetensors weights, single or sharded, are read)."
            ) from None
        try:
            return cls(file, safe_open(_descriptor_name(file), framework="pt"))
        except Exception as error:  # safetensors raises its own error types for damaged headers
            file.close()
            raise TorchpreError(
                f"{path} is not a readable safetensors file ({type(error).__name__}: {error})."
            ) from None

    def close(self) -> None:
        self.file.close()


def _descriptor_name(file: BinaryIO) -> str:
    """A name that opens the file of `file`'s descriptor itself, not whatever its path names now."""
    proc = Path("/proc/self/fd")
    return str((proc if proc.is_dir() else Path("/dev/fd")) / str(file.fileno()))


def _weight_files(folder: Path) -> dict[str, str] | None:
    """Tensor name -> file name, from the folder's index (None when it has none): an object whose `weight_map` is
    an object of strings, each the name of a file inside the folder."""
    index = folder / INDEX
    try:
        record = read_json(*located(folder, INDEX), "index")
    except FileNotFoundError:
        return None
    try:
        weight_map = json_field(record, "weight_map", dict)
        names = {tensor: json_field(weight_map, tensor, str, "weight_map") for tensor in weight_map}
    except FieldError as error:
        raise TorchpreError(
            f"{index} is not a safetensors index ({error}): it must hold an object whose weight_map names each "
            "tensor's file."
        ) from None
    return {
        tensor: str(PurePosixPath(check_name(name, index, f"weight_map[{tensor!r}]"))) for tensor, name in names.items()
    }


def _stored_tensors(folder: Path) -> dict[str, StoredTensor]:
    """Every tensor of the folder's safetensors files, from their headers; the index, if any, must name each
    tensor's file (and only files of the folder), and no other file is read."""
    index = folder / INDEX
    files = _weight_files(folder)
    stored: dict[str, StoredTensor] = {}
    for name in sorted(set(files.values())) if files else [SAFETENSORS]:
        opened = _Safetensors.open(folder, name, index if files is not None else None)
        try:
            for tensor in opened.handle.keys():
                if tensor in stored:
                    raise TorchpreError(f"{folder}: {tensor} is stored twice, in {stored[tensor].file} and {name}.")
                if files and files.get(tensor) != name:
                    raise TorchpreError(f"{index}: {tensor} is in {name}, but weight_map says {files.get(tensor)}.")
                part = opened.handle.get_slice(tensor)
                shape, dtype = torch.Size(part.get_shape()), _dtype(part.get_dtype(), folder / name, tensor)
                stored[tensor] = StoredTensor(folder, name, shape, dtype)
        finally:
            opened.close()
    absent = sorted((files or {}).keys() - stored.keys())
    if absent:
        tensor = absent[0]
        raise TorchpreError(f"{index}: weight_map names {tensor} in {files[tensor]}, which does not hold it.")
    return stored


def _dtype(name: str, path: Path, tensor: str) -> torch.dtype:
    if name not in _DTYPES:
        raise TorchpreError(f"{path}: {tensor} is stored as {name}, which torchpre does not read.")
    return _DTYPES[name]


def _is_scale(name: str) -> bool:
    return name.endswith(".weight" + SCALE_SUFFIX)


def _check_scale_shape(weight: str, stored: StoredTensor, scale: StoredTensor, block: tuple[int, int]) -> None:
    """A block-FP8 weight is a matrix, and its scales hold one value per block of it."""
    if len(stored.shape) != 2:
        raise TorchpreError(f"{stored.path}: {weight} has FP8 scales, but is no matrix: {tuple(stored.shape)}.")
    blocks = tuple(math.ceil(size / side) for size, side in zip(stored.shape, block))
    if tuple(scale.shape) != blocks:
        raise TorchpreError(
            f"{scale.path}: {weight}{SCALE_SUFFIX} has shape {tuple(scale.shape)}, but {weight} {tuple(stored.shape)} "
            f"in blocks of {block[0]} x {block[1]} (quantization_config.weight_block_size) has {blocks}."
        )


def _fp8_block(config: dict[str, Any], folder: Path) -> tuple[int, int] | None:
    """The (rows, columns) of a block-FP8 folder's scale blocks; None for an unquantized folder. Another
    quantization method is refused by name."""
    try:
        check_kinds(config, IRRELEVANT_KINDS)
    except TorchpreError as error:
        raise TorchpreError(f"{folder / CONFIG}: {error}") from None
    quantization = config.get("quantization_config")
    if not quantization:
        return None
    method, block = quantization.get("quant_method"), quantization.get("weight_block_size")
    sides = isinstance(block, list) and len(block) == 2 and all(type(side) is int and side > 0 for side in block)
    if method != "fp8" or not sides:
        raise TorchpreError(
            f"{folder / CONFIG}: quantization_config (quant_method {method!r}, weight_block_size {block!r}) is "
            "not supported; torchpre imports unquantized folders and block-FP8 ones (quant_method 'fp8' with a "
            "weight_block_size of two positive integers). Dequantize the weights first."
        )
    return block[0], block[1]
