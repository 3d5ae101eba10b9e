"""The state round-trip check: does a checkpoint, loaded under this job's layout, hold exactly what was saved?

`check_round_trip(manager, step_dir)` runs on every rank of a job that has just loaded `step_dir`: it
gathers the live training state to full tensors by canonical names (the checkpoint's keys: parameters, fp32
masters, every optimizer moment and step, the lr scheduler, the train step and data position), reads the
same from the checkpoint's files, and compares them bitwise. The layout that saved the checkpoint and the
one that loaded it may differ in any way (data, tensor, pipeline, expert parallelism, ZeRO stage, dtype).

Canonical form, so that any two layouts compare:
- every parameter has an fp32 value under `optimizer.<name>.master`: the master of a low-precision
  parameter, the parameter itself when it is fp32;
- a parameter saved and loaded in different dtypes is compared in the lower precision of the two (the
  fp32 values are compared in full through the masters);
- `train.world_size`, `train.dp` ... (the saving layout) and `train.seq_len` describe the run, not the state,
  and are left out; `rng.rank<r>` keys are compared for the ranks both sides have.
A key held by several ranks (DP replicas, the two pipeline copies of a tied weight) must agree bitwise
across them too.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchpre.checkpoint.integrity import FileCheck, Trust
from torchpre.checkpoint.layout import LAYOUT_KEYS as TRAIN_LAYOUT_KEYS
from torchpre.checkpoint.layout import STAGE_KEYS
from torchpre.checkpoint.manager import CheckpointManager
from torchpre.checkpoint.reader import Loader
from torchpre.checkpoint.state import flatten
from torchpre.checkpoint.values import read_values

LAYOUT_KEYS = tuple(f"train.{key}" for key in (*TRAIN_LAYOUT_KEYS, *STAGE_KEYS))
PER_RANK_PREFIX = "rng."


@dataclass
class RoundTripReport:
    """What differs between a checkpoint and the state a job loaded from it; empty lists mean bitwise equal."""

    missing: list[str] = field(default_factory=list)  # saved, but not in the loaded state
    unexpected: list[str] = field(default_factory=list)  # in the loaded state, but not saved
    different: list[str] = field(default_factory=list)  # "key: what differs"
    inconsistent: list[str] = field(default_factory=list)  # keys whose copies on different ranks disagree
    compared: int = 0

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.different or self.inconsistent)

    def __str__(self) -> str:
        if self.ok:
            return f"state round trip: {self.compared} keys bitwise equal"
        lines = [f"state round trip: {self.compared} keys compared"]
        for title, keys in (
            ("saved but not loaded", self.missing),
            ("loaded but not saved", self.unexpected),
            ("different", self.different),
            ("ranks disagree", self.inconsistent),
        ):
            if keys:
                lines.append(f"{title} ({len(keys)}): " + "; ".join(keys[:12]) + (" ..." if len(keys) > 12 else ""))
        return "\n".join(lines)


def check_round_trip(manager: CheckpointManager, step_dir: Path) -> RoundTripReport:
    """Compares the live state of `manager`'s job with `step_dir`, the checkpoint it loaded; a collective: call it
    on every rank. Every rank returns rank 0's report."""
    live, inconsistent = gather_live_state(manager)
    report = None
    if dist.get_rank() == 0:
        report = compare_states(read_saved_state(step_dir), live)
        report.inconsistent = inconsistent
    reports = [report]
    dist.broadcast_object_list(reports, src=0)
    return reports[0]


def gather_live_state(manager: CheckpointManager) -> tuple[dict[str, Any], list[str]]:
    """The job's full state in canonical form on rank 0 (empty elsewhere), and the keys on which ranks
    disagree. A collective: DTensors are gathered over their meshes, in the same key order on every rank."""
    local = {}
    for key, value in sorted(flatten(manager.state_dict()).items()):
        if isinstance(value, DTensor):
            value = value.full_tensor()
        local[key] = value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
    gathered: list[dict[str, Any] | None] = [None] * dist.get_world_size()
    dist.gather_object(local, gathered if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() != 0:
        return {}, []
    merged: dict[str, Any] = {}
    inconsistent = set()
    for state in gathered:
        for key, value in state.items():
            if key in merged and _difference(merged[key], value):
                inconsistent.add(key)
            merged.setdefault(key, value)
    return canonical(merged), sorted(inconsistent)


def read_saved_state(step_dir: Path) -> dict[str, Any]:
    """Every entry of the checkpoint `step_dir` (its tensors and `state.json`'s values), read whole in this process
    through the safe reader, in canonical form."""
    check = FileCheck(step_dir, Trust(allow_unverified=True))
    return canonical(flatten(Loader(check).load_whole()) | (read_values(check) or {}))


def canonical(flat: dict[str, Any]) -> dict[str, Any]:
    """`flat` (a flattened checkpoint state) without layout keys, with an fp32 master for every parameter."""
    state = {key: value for key, value in flat.items() if key not in LAYOUT_KEYS}
    for key in [k for k in state if k.startswith("model.")]:
        name, weight = key[len("model.") :], state[key]
        if f"optimizer.{name}.master" not in state and isinstance(weight, torch.Tensor):
            if weight.dtype == torch.float32:
                state[f"optimizer.{name}.master"] = weight
    return state


def compare_states(saved: dict[str, Any], live: dict[str, Any]) -> RoundTripReport:
    """Bitwise comparison of two canonical states (see the module doc for parameters in other dtypes)."""
    report = RoundTripReport()
    for key in sorted(saved.keys() | live.keys()):
        if key not in live:
            if not key.startswith(PER_RANK_PREFIX):
                report.missing.append(key)
        elif key not in saved:
            if not key.startswith(PER_RANK_PREFIX):
                report.unexpected.append(key)
        else:
            report.compared += 1
            difference = _difference(saved[key], live[key])
            if difference:
                report.different.append(f"{key}: {difference}")
    return report


def _difference(expected: object, actual: object) -> str:
    """'' when equal (bitwise for tensors, in the lower precision of two float dtypes), else what differs."""
    if isinstance(expected, torch.Tensor) != isinstance(actual, torch.Tensor):
        return f"{type(expected).__name__} vs {type(actual).__name__}"
    if not isinstance(expected, torch.Tensor):
        return "" if expected == actual else f"{expected!r} vs {actual!r}"
    if expected.shape != actual.shape:
        return f"shape {tuple(expected.shape)} vs {tuple(actual.shape)}"
    if expected.dtype != actual.dtype:
        if not (expected.is_floating_point() and actual.is_floating_point()):
            return f"dtype {expected.dtype} vs {actual.dtype}"
        lower = min((expected.dtype, actual.dtype), key=lambda dtype: torch.finfo(dtype).bits)
        expected, actual = expected.to(lower), actual.to(lower)
    if torch.equal(expected, actual):
        return ""
    if expected.is_floating_point():
        gap = (expected.double() - actual.double()).abs()
        return f"{int((gap > 0).sum())} of {gap.numel()} elements differ, by up to {gap.max().item():.3g}"
    return "values differ"
