"""What a checkpoint holds: a mapping of components (model, optimizer, LR schedule, data position, step, RNG, step
health), each saving and loading its own entry through `state_dict`/`load_state_dict` (DCP's `Stateful`), and the
checks that a checkpoint has what a load asks for, in the shapes it asks for.

A component that loads into other tensors than it saves (the model's weights go through the optimizer's fp32
masters), or whose entry may lack keys in some checkpoints (RNG states of ranks the saving job did not have,
entries an older torchpre did not write), says what to load with `load_targets(saved)`, given the checkpoint's
flattened keys; otherwise its `state_dict()` is what loads, every key required.
"""

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from torchpre.checkpoint.integrity import FileCheck, Trust, all_gather
from torchpre.checkpoint.reader import Loader, read_metadata
from torchpre.checkpoint.values import read_values
from torchpre.errors import TorchpreError, UntrustedInput


@runtime_checkable
class Checkpointable(Protocol):
    """A component of the training state: `torch.distributed.checkpoint.stateful.Stateful`. `state_dict()` returns
    live tensors (DTensors where sharded) so that DCP saves them and loads into them in place; `load_state_dict`
    gets the loaded entry afterwards (non-tensor values are only there)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def load_targets(component: Checkpointable, saved: set[str]) -> dict[str, Any]:
    """What `component` loads from a checkpoint with the flattened keys `saved`."""
    targets = getattr(component, "load_targets", None)
    return targets(saved) if targets is not None else component.state_dict()


def load_component(component: Checkpointable, key: str, state: dict[str, Any], step_dir: Path) -> None:
    """`component.load_state_dict(state)`; a value it refuses (a ValueError: values of the right types and ranges
    that do not fit together, such as a data position off the batch grid) is bad input naming the checkpoint."""
    try:
        component.load_state_dict(state)
    except ValueError as error:
        raise UntrustedInput(
            f"{step_dir}: the entry {key!r} cannot be loaded ({error}). torchpre never saves such values together: "
            "the checkpoint was altered or written by another tool. Load another checkpoint (docs/security.md)."
        ) from None


class RNGState:
    """This rank's generator states: the CPU one and, in a process that uses CUDA, its current device's, under
    `rank{r}` and `cuda_rank{r}`. A rank the saving job did not have finds none, and keeps its own."""

    def __init__(self) -> None:
        self.rank = dist.get_rank() if dist.is_initialized() else 0

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {f"rank{self.rank}": torch.get_rng_state()}
        if torch.cuda.is_initialized():
            state[f"cuda_rank{self.rank}"] = torch.cuda.get_rng_state()
        return state

    def load_targets(self, saved: set[str]) -> dict[str, torch.Tensor]:
        return {key: value for key, value in self.state_dict().items() if f"rng.{key}" in saved}

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        if f"rank{self.rank}" in state_dict:
            torch.set_rng_state(state_dict[f"rank{self.rank}"])
        if f"cuda_rank{self.rank}" in state_dict:
            torch.cuda.set_rng_state(state_dict[f"cuda_rank{self.rank}"])


def checkpoint_metadata(check: FileCheck, allow_pickle: bool = False) -> dict[str, Any]:
    """The checked folder's flattened keys ("model.layers.0...") and their metadata, `state.json`'s values as
    BytesStorageMetadata; a clear error if the folder is not a readable checkpoint (`allow_pickle`: see
    `reader.read_metadata`)."""
    metadata = read_metadata(check.step_dir, check, allow_pickle).state_dict_metadata
    values = read_values(check) or {}
    return metadata | dict.fromkeys(values, BytesStorageMetadata())


def read_train_values(
    step_dir: Path, keys: Sequence[str], trust: Trust, allow_pickle: bool = False
) -> dict[str, float]:
    """The checkpoint's "train" entries named in `keys` that it holds (a scalar each: global batch, seq_len, RoPE),
    read without a process group, before anything is built, from files the manifest vouches for (with
    checkpoint.`allow_pickle` as the load will); {} if it holds none or cannot be read (a damaged checkpoint is named,
    and skipped, by the checked load that follows). A folder that holds code or names files outside itself is refused
    at once (UntrustedInput)."""
    check = FileCheck(step_dir, trust)
    try:
        values = read_values(check)
        if values is not None:
            return {key: float(values[f"train.{key}"]) for key in keys if f"train.{key}" in values}
        recorded = read_metadata(step_dir, check, allow_pickle).state_dict_metadata
        request = {"train": {key: 0.0 for key in keys if f"train.{key}" in recorded}}
        if not request["train"]:
            return {}
        Loader(check, allow_pickle).load(request, no_dist=True)
    except UntrustedInput:
        raise
    except Exception:  # DCP raises several types for damaged files
        return {}
    return {key: float(value) for key, value in request["train"].items()}


def flatten(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`state` in one level, nested keys joined with dots as DCP names them ("optimizer.w.exp_avg")."""
    flat = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def state_bytes(state: dict[str, Any]) -> int:
    """The bytes of the tensors a save of `state` (this rank's part) writes over all ranks, each key once as DCP
    writes it: a DTensor at its global size, a tensor replicated on several ranks once. Every rank calls it."""
    sizes = {
        key: value.numel() * value.element_size()
        for key, value in flatten(state).items()
        if isinstance(value, torch.Tensor)
    }
    return sum({key: size for part in all_gather(sizes) for key, size in part.items()}.values())


def check_shapes(request: dict[str, Any], saved: dict[str, Any], step_dir: Path) -> None:
    """Raises, naming every tensor of `request` (a state dict to load) whose saved shape differs, every entry saved
    as a tensor where `request` holds a plain value or the other way round (DCP would fail deep inside the load), and
    the model weights the checkpoint lacks."""
    mismatched, missing = [], []
    for key, value in flatten(request).items():
        meta = saved.get(key)
        if key.startswith("model.") and meta is None:
            missing.append(key)
        elif meta is not None and isinstance(meta, TensorStorageMetadata) != isinstance(value, torch.Tensor):
            mismatched.append(f"{key}: checkpoint {_kind(meta)} vs model {_kind(value)}")
        elif isinstance(meta, TensorStorageMetadata) and tuple(meta.size) != tuple(value.shape):
            mismatched.append(f"{key}: checkpoint {tuple(meta.size)} vs model {tuple(value.shape)}")
    if mismatched or missing:
        details = "; ".join(mismatched[:8] + [f"{k}: not in the checkpoint" for k in missing[:8]])
        raise TorchpreError(
            f"The checkpoint at {step_dir} does not fit this model ({len(mismatched)} entries of another shape or "
            f"kind, {len(missing)} missing): {details}. Check model.flavor and model.tokenizer_path against the "
            "checkpoint's config.toml."
        )


def _kind(value: object) -> str:
    if isinstance(value, TensorStorageMetadata):
        return f"a tensor of shape {tuple(value.size)}"
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return "a plain value"


def require_present(request: dict[str, Any], saved: dict[str, Any], step_dir: Path) -> None:
    """Raises on every rank, naming a few of them, their count and the folder, if the checkpoint lacks entries
    that some rank's `request` asks for."""
    missing = [key for key in flatten(request) if key not in saved]
    if dist.is_initialized():
        missing = sorted({key for part in all_gather(missing) for key in part})
    if missing:
        shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise TorchpreError(
            f"The checkpoint {step_dir} lacks {len(missing)} entries this job loads: {shown}. It was saved by "
            "another model or version of torchpre. Load another checkpoint, or leave that part out on purpose "
            "with checkpoint.exclude_from_loading (e.g. optimizer, lr_scheduler)."
        )
