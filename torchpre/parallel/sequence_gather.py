"""Sequence parallelism that keeps the sequence shard for backward and gathers it again there (Megatron-LM's).

Under sequence parallelism a module such as a block's attention all-gathers its sequence-sharded input
(`PrepareModuleInput`: Shard(1) -> Replicate) and its column-parallel projections save that gathered input for
their weight gradients: tp times the shard, per module. `SaveShardForBackward` makes autograd keep the shard
instead and all-gather it again when backward first asks for it: tp - 1 shards less memory per module, one more
all-gather per module in backward (parallelism.sequence_parallel_save_shard).

It works on what autograd saves (`torch.autograd.graph.saved_tensors_hooks` around the module's forward), so the
model and the projections' styles stay as they are. A saved tensor is recognised as the gathered input, or a view
of it (a linear on a 3-D input saves a reshaped view), by its storage; every other saved tensor passes untouched.
When saved-tensor hooks are already active around the module (activation checkpointing, which then recomputes
the gather itself), the module leaves them alone: hooks do not nest, and the inner ones would take every saved
tensor from the outer ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle


@dataclass(frozen=True)
class _SavedView:
    """A saved view of the gathered input: its geometry over the gathered local tensor and, when autograd saved a
    DTensor, that DTensor's layout (not the DTensor, which would keep the gathered tensor alive)."""

    size: torch.Size
    stride: tuple[int, ...]
    offset: int
    dtensor_layout: tuple[DeviceMesh, tuple[Placement, ...], torch.Size, tuple[int, ...]] | None


class SaveShardForBackward(ParallelStyle):
    """Applied after the module's `PrepareModuleInput` (whose pre-hook gathers the first input over the sequence):
    its forward saves the shard of that input, not the gathered tensor, and backward gathers it again."""

    def __init__(self, sequence_dim: int = 1) -> None:
        super().__init__()
        self.sequence_dim = sequence_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        hooks = _ModuleHooks(device_mesh, self.sequence_dim)
        module.register_forward_pre_hook(hooks.keep_shard, prepend=True)  # before the gather
        module.register_forward_pre_hook(hooks.enter)  # after it
        module.register_forward_hook(hooks.exit, always_call=True)
        return module


class _ModuleHooks:
    """One module's hooks: between `enter` and `exit` of each forward, that forward's `_GatheredInput` packs and
    unpacks what autograd saves."""

    def __init__(self, mesh: DeviceMesh, sequence_dim: int) -> None:
        self.mesh, self.sequence_dim = mesh, sequence_dim
        self.shard: Tensor | None = None
        self.hooks: saved_tensors_hooks | None = None

    def keep_shard(self, module: nn.Module, args: tuple) -> None:
        if torch.is_grad_enabled() and torch._C._autograd._top_saved_tensors_default_hooks(False) is None:
            self.shard = _local(args[0]).detach()

    def enter(self, module: nn.Module, args: tuple) -> None:
        shard, self.shard = self.shard, None
        if shard is None or _local(args[0]).shape[self.sequence_dim] == shard.shape[self.sequence_dim]:
            return  # no backward, outer hooks, or nothing gathered here
        forward = _GatheredInput(shard, _local(args[0]).untyped_storage()._cdata, self.mesh, self.sequence_dim)
        self.hooks = saved_tensors_hooks(forward.pack, forward.unpack)
        self.hooks.__enter__()

    def exit(self, module: nn.Module, args: tuple, output: object) -> None:
        self.shard = None
        if self.hooks is not None:
            self.hooks.__exit__(None, None, None)
            self.hooks = None


class _GatheredInput:
    """One forward's gathered input, saved as its shard. Backward gathers the shard once for all the views saved
    of it (q, k and v's projections: one all-gather, not three) and drops the gathered tensor when the last of
    them has been unpacked."""

    def __init__(self, shard: Tensor, storage: int, mesh: DeviceMesh, sequence_dim: int) -> None:
        self.shard, self.storage, self.mesh, self.sequence_dim = shard, storage, mesh, sequence_dim
        self.pending = 0  # views packed and not yet unpacked
        self.gathered: Tensor | None = None

    def pack(self, tensor: Tensor) -> Tensor | _SavedView:
        local = _local(tensor)
        if local.untyped_storage()._cdata != self.storage:
            return tensor
        self.pending += 1
        layout = None
        if isinstance(tensor, DTensor):
            layout = (tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride())
        return _SavedView(local.size(), local.stride(), local.storage_offset(), layout)

    def unpack(self, saved: Tensor | _SavedView) -> Tensor:
        if not isinstance(saved, _SavedView):
            return saved
        gathered = self.gathered if self.gathered is not None else self._gather()
        self.pending -= 1
        self.gathered = gathered if self.pending > 0 else None
        view = gathered.as_strided(saved.size, saved.stride, saved.offset)
        if saved.dtensor_layout is None:
            return view
        mesh, placements, shape, stride = saved.dtensor_layout
        return DTensor.from_local(view, mesh, placements, shape=shape, stride=stride, run_check=False)

    def _gather(self) -> Tensor:
        shard = DTensor.from_local(self.shard, self.mesh, [Shard(self.sequence_dim)], run_check=False)
        return shard.redistribute(self.mesh, [Replicate()]).to_local()


def _local(tensor: Tensor) -> Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor
