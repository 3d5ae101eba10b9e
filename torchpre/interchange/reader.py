"""A Hugging Face safetensors folder, read one box of one tensor at a time.

The folder is `config.json` plus `model.safetensors`, or numbered files and `model.safetensors.index.json`, whose
`weight_map` names each tensor's file (every name goes through `torchpre.confined.confined_path`). Only the files'
headers are read up front (names, shapes, dtypes); `read(name, box)` then reads the bytes of that box through
safetensors' `safe_open` slices, which map the file and copy nothing until the box is used. A block-FP8 folder
(DeepSeek-V3 as released: `quantization_config` with quant_method 'fp8' and a `weight_block_size`) stores each
linear weight in float8_e4m3fn with a float32 `weight_scale_inv` per block: `read` dequantizes the box it reads
(its FP8 values times their blocks' scales, in bfloat16, the dtype the released models trained in), so no rank
needs a whole weight to dequantize its shard. Nothing is unpickled; safetensors holds only tensors.

A file stays mapped only while `reading()` is open: the pages a read touched leave the process when it closes.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from torchpre.confined import confined_path
from torchpre.errors import TorchpreError
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
    """Where a tensor is stored and as what."""

    path: Path
    shape: torch.Size
    dtype: torch.dtype


def is_hf_folder(path: Path) -> bool:
    """A folder with a config.json and safetensors weights (one file, or an index), as `save_pretrained` writes."""
    return (path / CONFIG).is_file() and ((path / SAFETENSORS).is_file() or (path / INDEX).is_file())


def read_config(folder: Path) -> dict[str, Any]:
    """The folder's config.json, which must hold a JSON object."""
    if not folder.is_dir():
        raise TorchpreError(
            f"Hugging Face folder {folder} does not exist. Give a folder holding config.json and model.safetensors."
        )
    config = read_json(folder / CONFIG)
    if not isinstance(config, dict):
        raise TorchpreError(f"{folder / CONFIG} holds a JSON {type(config).__name__}, not a config object.")
    return config


def read_json(path: Path) -> Any:
    if not path.is_file():
        raise TorchpreError(f"{path} does not exist.")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise TorchpreError(f"{path} is not valid JSON: {error}.") from None


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
        for weight in self.scales:
            if weight not in stored:
                raise TorchpreError(f"{folder}: {weight}{SCALE_SUFFIX} has no weight {weight} to scale.")
        self.stored = stored
        self.bytes_read = 0
        self._handles: dict[Path, Any] | None = None

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
        self._handles = {}
        try:
            yield
        finally:
            self._handles = None

    def read(self, name: str, box: Box) -> Tensor:
        """The box of tensor `name` (missing or open slices: whole dimensions), dequantized if it is block-FP8."""
        stored = self.stored[name]
        whole = (*box, *[slice(None)] * (len(stored.shape) - len(box)))
        box = tuple(slice(*part.indices(size)[:2]) for part, size in zip(whole, stored.shape))
        value = self._slice(stored.path, name, box)
        if name not in self.scales:
            return value
        rows, columns = box
        (height, width), scale = self.block, self.scales[name]
        first_row, first_column = rows.start // height, columns.start // width
        scale_box = (slice(first_row, -(-rows.stop // height)), slice(first_column, -(-columns.stop // width)))
        blocks = self._slice(scale.path, name + SCALE_SUFFIX, scale_box).float()
        blocks = blocks.repeat_interleave(height, 0).repeat_interleave(width, 1)
        top, left = rows.start - first_row * height, columns.start - first_column * width
        blocks = blocks[top : top + value.shape[0], left : left + value.shape[1]]
        return (value.float() * blocks).to(torch.bfloat16)

    def _slice(self, path: Path, name: str, box: Box) -> Tensor:
        if self._handles is None:
            raise RuntimeError("HFFolder.read outside `with folder.reading():`")
        if path not in self._handles:
            self._handles[path] = _open(path)
        value = self._handles[path].get_slice(name)[box]
        self.bytes_read += value.numel() * value.element_size()
        return value


def _stored_tensors(folder: Path) -> dict[str, StoredTensor]:
    """Every tensor of the folder's safetensors files, from their headers; the index, if any, must name each
    tensor's file (and only files of the folder)."""
    index = folder / INDEX
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise TorchpreError(f"{index} has no weight_map object naming each tensor's file.")
        files = {name: confined_path(folder, file, index, f"weight_map[{name!r}]") for name, file in weight_map.items()}
    else:
        files = {}
    paths = sorted(set(files.values())) or [folder / SAFETENSORS]
    stored: dict[str, StoredTensor] = {}
    for path in paths:
        if not path.is_file():
            raise TorchpreError(f"{path} does not exist (only safetensors weights, single or sharded, are read).")
        handle = _open(path)
        for name in handle.keys():
            if name in stored:
                raise TorchpreError(f"{folder}: {name} is stored twice, in {stored[name].path.name} and {path.name}.")
            if files and files.get(name) != path:
                raise TorchpreError(f"{index}: {name} is in {path.name}, but weight_map says {files.get(name)}.")
            part = handle.get_slice(name)
            stored[name] = StoredTensor(path, torch.Size(part.get_shape()), _dtype(part.get_dtype(), path, name))
    absent = sorted(files.keys() - stored.keys())
    if absent:
        name = absent[0]
        raise TorchpreError(f"{index}: weight_map names {name} in {files[name].name}, which does not hold it.")
    return stored


def _open(path: Path) -> Any:
    try:
        return safe_open(path, framework="pt")
    except Exception as error:  # safetensors raises its own error types for damaged headers
        raise TorchpreError(f"{path} is not a readable safetensors file ({type(error).__name__}: {error}).") from None


def _dtype(name: str, path: Path, tensor: str) -> torch.dtype:
    if name not in _DTYPES:
        raise TorchpreError(f"{path}: {tensor} is stored as {name}, which torchpre does not read.")
    return _DTYPES[name]


def _is_scale(name: str) -> bool:
    return name.endswith(".weight" + SCALE_SUFFIX)


def _fp8_block(config: dict[str, Any], folder: Path) -> tuple[int, int] | None:
    """The (rows, columns) of a block-FP8 folder's scale blocks; None for an unquantized folder. Another
    quantization method is refused by name."""
    quantization = config.get("quantization_config")
    if not quantization:
        return None
    method, block = quantization.get("quant_method"), quantization.get("weight_block_size")
    if method != "fp8" or not isinstance(block, list) or len(block) != 2:
        raise TorchpreError(
            f"{folder / CONFIG}: quantization_config (quant_method {method!r}, weight_block_size {block!r}) is "
            "not supported; torchpre imports unquantized folders and block-FP8 ones (quant_method 'fp8' with a "
            "weight_block_size). Dequantize the weights first."
        )
    return block[0], block[1]
