"""The non-tensor part of the training state (the step, the data position, the LR schedule's counters, the step
guard's), saved as JSON in `state.json` beside DCP's files rather than pickled into them, so that a checkpoint holds
nothing a reader must unpickle beyond DCP's `.metadata` (docs/security.md), and a person can read where a run stopped.

`state.json` is {flattened name: value}, names as DCP's ("train.step", "lr_scheduler.base_lrs"). It is written by rank
0 before the tensors, covered by the manifest like every other file, and read back through the manifest check.
Checkpoints written before it existed keep these values as DCP entries, which load as plain values only (reader.py).
"""

import json
import math
from pathlib import Path
from typing import Any

import torch

from torchpre.checkpoint.integrity import FileCheck
from torchpre.errors import TorchpreError

VALUES = "state.json"


def split_values(state: dict[str, Any], prefix: str = "") -> tuple[dict[str, Any], dict[str, Any]]:
    """`state` (nested) as its tensors (the same nesting, for DCP) and its other leaves, by flattened name."""
    tensors, values = {}, {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            tensors[key], nested = split_values(value, f"{name}.")
            values |= nested
        elif isinstance(value, torch.Tensor):
            tensors[key] = value
        else:
            values[name] = value
    return tensors, values


def encode_values(values: dict[str, Any]) -> bytes:
    """`values` as `state.json`'s bytes. A value JSON cannot hold exactly is a bug of the component that gave it."""
    for name, value in values.items():
        if not _exact_in_json(value):
            raise TypeError(
                f"the checkpoint entry {name!r} holds {value!r} ({type(value).__name__}): torchpre saves non-tensor "
                "state as JSON, so a component's state_dict may hold only tensors, numbers, strings, booleans, None "
                "and lists or dicts of them"
            )
    return json.dumps(values, indent=1, sort_keys=True).encode("utf-8")


def _exact_in_json(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return True  # repr round-trips; NaN and infinities as JSON's NaN/Infinity extension
    if isinstance(value, (list, tuple)):
        return all(map(_exact_in_json, value))
    if isinstance(value, dict):
        return all(isinstance(key, str) and _exact_in_json(item) for key, item in value.items())
    return False


def read_values(check: FileCheck) -> dict[str, Any] | None:
    """The checked folder's `state.json`; None when it has none (a checkpoint from before it existed, or one
    converted from Hugging Face, which holds weights only)."""
    path = check.step_dir / VALUES
    if not path.is_file() and not path.is_symlink():
        return None
    check.require(VALUES)
    try:
        values = json.loads(path.read_text(encoding="utf-8"), parse_constant=_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise TorchpreError(f"{path} is not valid JSON ({error}): the checkpoint is damaged.") from None
    if not isinstance(values, dict):
        raise TorchpreError(f"{path} holds {type(values).__name__}, not an object of named values.")
    return values


def _constant(name: str) -> float:
    return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}[name]


def without_values(state: dict[str, Any], values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`state` (a load request) without the leaves `values` holds: what DCP loads."""
    kept = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            kept[key] = without_values(value, values, f"{name}.")
        elif name not in values:
            kept[key] = value
    return kept


def put_values(loaded: dict[str, Any], request: dict[str, Any], values: dict[str, Any], prefix: str = "") -> None:
    """Puts into `loaded` (what DCP loaded of `request`) the leaves of `request` that `values` holds."""
    for key, value in request.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            put_values(loaded.setdefault(key, {}), value, values, f"{name}.")
        elif name in values:
            loaded[key] = values[name]


def values_path(step_dir: Path) -> Path:
    return step_dir / VALUES
