"""Tensors that autograd does not keep for backward but rebuilds there: the one home of that mechanism.

Two memory features make what a module's forward saves cheaper to keep: sequence parallelism's gathered input,
kept as its shard and gathered again (`torchpre.parallel.sequence_gather`), and an MLP's activation, recomputed
from its projections' outputs (`torchpre.parallel.mlp_activation`). Both work on what autograd saves, through one
pair of `torch.autograd.graph.saved_tensors_hooks` around the module's forward (`rebuilt_saves`): hooks do not
nest (inner ones would take every saved tensor from outer ones), so every rebuild registered during one forward
shares that pair. A saved tensor is recognised as a registered tensor, or a view of it (a linear on a 3-D input
saves a reshaped view), by its storage; every other saved tensor passes untouched. When saved-tensor hooks are
already active around the module (activation checkpointing, which recomputes everything itself), the module
installs none and nothing registers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

# The tables of the forwards running now, innermost last, each with the hooks that use it (kept here, not on the
# table: a table holding its hooks' bound methods would be a reference cycle, alive until a garbage collection).
_active: list[tuple[SavedTensorTable, saved_tensors_hooks] | None] = []


def outer_hooks_active() -> bool:
    """Whether saved-tensor hooks (activation checkpointing's) are active here already."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def active_table() -> SavedTensorTable | None:
    """The table of the innermost module forward that `rebuilt_saves` hooks, if one runs now."""
    return _active[-1][0] if _active and _active[-1] is not None else None


def rebuilt_saves(module: nn.Module) -> None:
    """Gives every forward of `module` its own `SavedTensorTable`, active from before its first forward pre-hook
    that registers (add those after this call) to after its forward; once per module, whoever asks first."""
    if getattr(module, "_rebuilt_saves", False):
        return
    module._rebuilt_saves = True
    module.register_forward_pre_hook(_enter)
    module.register_forward_hook(_exit, always_call=True)


def _enter(module: nn.Module, args: tuple) -> None:
    if torch.is_grad_enabled() and not outer_hooks_active():
        table = SavedTensorTable()
        hooks = saved_tensors_hooks(table.pack, table.unpack)
        hooks.__enter__()
        _active.append((table, hooks))
    else:
        _active.append(None)


def _exit(module: nn.Module, args: tuple, output: object) -> None:
    active = _active.pop()
    if active is not None:
        active[1].__exit__(None, None, None)


@dataclass(frozen=True)
class _SavedView:
    """A saved view of a registered tensor: the registration, the view's geometry over the registered local tensor
    and, when autograd saved a DTensor, that DTensor's layout (not the DTensor, which would keep the tensor alive)."""

    registered: _Registered
    size: torch.Size
    stride: tuple[int, ...]
    offset: int
    dtensor_layout: tuple[DeviceMesh, tuple[Placement, ...], torch.Size, tuple[int, ...]] | None


class _Registered:
    """One registered tensor, saved as `_SavedView`s. Backward rebuilds it once for all the views saved of it
    (q, k and v's projections of one gathered input: one all-gather, not three) and drops it when the last of them
    has been unpacked."""

    def __init__(self, rebuild: Callable[[], Tensor]) -> None:
        self.rebuild = rebuild
        self.pending = 0  # views packed and not yet unpacked
        self.rebuilt: Tensor | None = None

    def pack(self, tensor: Tensor) -> _SavedView:
        self.pending += 1
        local = local_tensor(tensor)
        layout = None
        if isinstance(tensor, DTensor):
            layout = (tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride())
        return _SavedView(self, local.size(), local.stride(), local.storage_offset(), layout)

    def unpack(self, saved: _SavedView) -> Tensor:
        rebuilt = self.rebuilt if self.rebuilt is not None else self.rebuild()
        self.pending -= 1
        self.rebuilt = rebuilt if self.pending > 0 else None
        view = rebuilt.as_strided(saved.size, saved.stride, saved.offset)
        if saved.dtensor_layout is None:
            return view
        mesh, placements, shape, stride = saved.dtensor_layout
        return DTensor.from_local(view, mesh, placements, shape=shape, stride=stride, run_check=False)


class SavedTensorTable:
    """One forward's registered tensors, and the pack and unpack hooks that save them as views to rebuild."""

    def __init__(self) -> None:
        self.registered: dict[int, _Registered] = {}  # storage -> its registration

    def register(self, tensor: Tensor, rebuild: Callable[[], Tensor]) -> None:
        """From now on until the forward ends, autograd saves `tensor` (or a view of it) as a marker, and backward
        calls `rebuild()` for it: `tensor`'s local tensor again, with its values."""
        self.registered[local_tensor(tensor).untyped_storage()._cdata] = _Registered(rebuild)

    def pack(self, tensor: Tensor) -> Tensor | _SavedView:
        registered = self.registered.get(local_tensor(tensor).untyped_storage()._cdata)
        return tensor if registered is None else registered.pack(tensor)

    @staticmethod
    def unpack(saved: Tensor | _SavedView) -> Tensor:
        return saved.registered.unpack(saved) if isinstance(saved, _SavedView) else saved


def local_tensor(tensor: Tensor) -> Tensor:
    """A DTensor's local tensor; a plain tensor itself."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor
