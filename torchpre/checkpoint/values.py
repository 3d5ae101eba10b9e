"""The non-tensor part of the training state (the step, the data position, the LR schedule's counters, the step
guard's), saved as JSON in `state.json` beside DCP's files rather than pickled into them, so that a checkpoint holds
nothing a reader must unpickle beyond DCP's `.metadata` (docs/security.md), and a person can read where a run stopped.

`state.json` is {flattened name: value}, names as DCP's ("train.step", "lr_scheduler.base_lrs"). It is written by rank
0 before the tensors, covered by the manifest like every other file, and read back through the manifest check.
Checkpoints written before it existed keep these values as DCP entries, which load as plain values only (reader.py).

Read back, every value is checked before anything uses it: torchpre's own against `RULES` (a step or a count is never
negative, a size never below 1, a learning rate finite; the step is the folder's), and every value a load puts into a
component against the live value it replaces: the same JSON type, a list of the same length, item by item. The values
that record what the saving run was (its layout, its data stages) are compared with this run's by their component,
never restored: only their rule binds them.
"""

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchpre.checkpoint.integrity import FileCheck, folder_step
from torchpre.errors import UntrustedInput
from torchpre.json_input import LIMITS, JsonValue, loads

VALUES = "state.json"


def _integer(least: int) -> Callable[[JsonValue], bool]:
    return lambda value: type(value) is int and least <= value < 2**63  # what an int64 tensor or counter holds


def _finite(value: JsonValue) -> bool:
    return type(value) in (int, float) and math.isfinite(value) and value >= 0


def _list_of(rule: Callable[[JsonValue], bool]) -> Callable[[JsonValue], bool]:
    return lambda value: isinstance(value, list) and all(map(rule, value))


@dataclass(frozen=True)
class Rule:
    """What a value of `state.json` may hold (`holds`, and in words: `expected`). `describes_run`: a record of the
    saving run (its layout, its stages), which a resume compares with its own, so its shape may be another's."""

    holds: Callable[[JsonValue], bool]
    expected: str
    describes_run: bool = False


def _stages(value: JsonValue) -> bool:
    return isinstance(value, list) and all(isinstance(stage, dict) for stage in value)  # fields: StageTable.from_record


_COUNTS = r"(train|dataloader)\.consumed_samples|train\.step|health\.\w+|lr_scheduler\.(last_epoch|_step_count)"
_SIZES = ("global_batch_size", "accumulation_steps", "world_size", "dp", "tp", "pp", "ep", "cp", "seq_len")
# What each value of `state.json` may hold, by its flattened name (a pattern).
RULES: dict[str, Rule] = {
    rf"train\.({'|'.join(_SIZES)})": Rule(_integer(1), "a size (an integer of at least 1)", describes_run=True),
    _COUNTS: Rule(_integer(0), "a count (an integer of 0 or more)"),
    r"dataloader\.order_version": Rule(_integer(1), "a version (an integer of at least 1)"),
    r"train\.rope_\w+": Rule(_finite, "a finite number of 0 or more", describes_run=True),
    r"train\.data_stages": Rule(_stages, "a list of stage records", describes_run=True),
    r"lr_scheduler\.(base_lrs|_last_lr)": Rule(_list_of(_finite), "a list of finite learning rates of 0 or more"),
    r"lr_scheduler\.(_is_initial|_get_lr_called_within_step)": Rule(lambda value: type(value) is bool, "true or false"),
    r"lr_scheduler\.lr_lambdas": Rule(_list_of(lambda value: value is None), "a list of nulls"),
}  # fmt: skip
_COMPILED = [(re.compile(pattern), rule) for pattern, rule in RULES.items()]


def rule_of(name: str) -> Rule | None:
    """The rule `state.json`'s value `name` must meet; None for a name torchpre's own components never save."""
    return next((rule for pattern, rule in _COMPILED if pattern.fullmatch(name)), None)


def split_values(state: dict[str, Any], prefix: str = "") -> tuple[dict[str, Any], dict[str, object]]:
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


def encode_values(values: dict[str, object]) -> bytes:
    """`values` as `state.json`'s bytes. A value JSON cannot hold exactly is a bug of the component that gave it."""
    for name, value in values.items():
        if not _exact_in_json(value):
            raise TypeError(
                f"the checkpoint entry {name!r} holds {value!r} ({type(value).__name__}): torchpre saves non-tensor "
                "state as JSON, so a component's state_dict may hold only tensors, numbers, strings, booleans, None "
                "and lists or dicts of them"
            )
    return json.dumps(values, indent=1, sort_keys=True).encode("utf-8")


def _exact_in_json(value: object) -> bool:
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return True  # repr round-trips; NaN and infinities as JSON's NaN/Infinity extension
    if isinstance(value, (list, tuple)):
        return all(map(_exact_in_json, value))
    if isinstance(value, dict):
        return all(isinstance(key, str) and _exact_in_json(item) for key, item in value.items())
    return False


def read_values(check: FileCheck) -> dict[str, JsonValue] | None:
    """The checked folder's `state.json`, every value that has a rule meeting it (`RULES`) and its step the folder's;
    None when it has none (a checkpoint from before it existed, or one converted from Hugging Face, which holds
    weights only)."""
    path = check.step_dir / VALUES
    try:
        read = loads(check.read(VALUES, LIMITS["state"]), path)
    except FileNotFoundError:
        return None
    values = check_values(read, path)
    step, saved = folder_step(check.step_dir), values.get("train.step")
    if step is not None and saved is not None and saved != step:
        raise _bad_value(path, "train.step", saved, f"the step of its folder, {check.step_dir.name}")
    return values


def check_values(values: JsonValue, path: Path) -> dict[str, JsonValue]:
    """`values` (read from `path`) once it is an object of named values each meeting its rule; raises, naming `path`,
    otherwise."""
    if not isinstance(values, dict):
        raise UntrustedInput(f"{path} holds a JSON {type(values).__name__}, not an object of named values.")
    for name, value in values.items():
        rule = rule_of(name)
        if rule is not None and not rule.holds(value):
            raise _bad_value(path, name, value, rule.expected)
    return values


def _bad_value(path: Path, name: str, value: JsonValue, expected: str) -> UntrustedInput:
    shown = json.dumps(value)
    return UntrustedInput(
        f"{path}: {name!r} is {shown if len(shown) <= 60 else shown[:57] + '...'}, not {expected}. torchpre never "
        "saves such a value: the checkpoint was altered or written by another tool. Load another checkpoint "
        "(docs/security.md)."
    )


def without_values(state: dict[str, Any], values: dict[str, JsonValue], prefix: str = "") -> dict[str, Any]:
    """`state` (a load request) without the leaves `values` holds: what DCP loads."""
    kept = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            kept[key] = without_values(value, values, f"{name}.")
        elif name not in values:
            kept[key] = value
    return kept


def put_values(
    loaded: dict[str, Any], request: dict[str, Any], values: dict[str, JsonValue], step_dir: Path, prefix: str = ""
) -> None:
    """Puts into `loaded` (what DCP loaded of `request`) the leaves of `request` that `values` (`step_dir`'s
    state.json) holds, each once shown to have the shape of the live value it replaces (`same_shape`), unless it
    records the saving run (`Rule.describes_run`)."""
    for key, value in request.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            put_values(loaded.setdefault(key, {}), value, values, step_dir, f"{name}.")
        elif name in values:
            rule = rule_of(name)
            expected = None if rule is not None and rule.describes_run else same_shape(values[name], value)
            if expected is not None:
                raise _bad_value(step_dir / VALUES, name, values[name], expected)
            loaded[key] = values[name]


def same_shape(saved: JsonValue, live: object) -> str | None:
    """None when `saved` (from JSON) can replace the live value `live`: a boolean for a boolean, an integer for an
    integer, a number for a float, a string for a string, null for None, a list of as many items for a list or
    tuple (item by item), an object of the same keys for a dict; otherwise what it should have been, in words."""
    if isinstance(live, bool) or live is None or isinstance(live, str):
        kind = type(live)
        return None if type(saved) is kind else {bool: "true or false", str: "a string"}.get(kind, "null")
    if isinstance(live, int):
        return None if type(saved) is int else "an integer"
    if isinstance(live, float):
        return None if type(saved) in (int, float) else "a number"
    if isinstance(live, (list, tuple)):
        if not isinstance(saved, list) or len(saved) != len(live):
            return f"a list of {len(live)} items"
        return next(filter(None, map(same_shape, saved, live)), None)
    if isinstance(live, dict):
        if not isinstance(saved, dict) or saved.keys() != live.keys():
            return f"an object with the keys {sorted(live)}"
        return next(filter(None, (same_shape(saved[key], value) for key, value in live.items())), None)
    return None


def values_path(step_dir: Path) -> Path:
    return step_dir / VALUES
