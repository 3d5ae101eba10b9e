"""Sequence parallelism that keeps the sequence shard for backward and gathers it again there (Megatron-LM's).

Under sequence parallelism a module such as a block's attention all-gathers its sequence-sharded input
(`PrepareModuleInput`: Shard(1) -> Replicate) and its column-parallel projections save that gathered input for
their weight gradients: tp times the shard, per module. `SaveShardForBackward` makes autograd keep the shard
instead and all-gather it again when backward first asks for it: tp - 1 shards less memory per module, one more
all-gather per module in backward (parallelism.sequence_parallel_save_shard).

It works on what autograd saves (`torchpre.parallel.saved_tensors`: the gathered input is registered as a tensor
rebuilt in backward), so the model and the projections' styles stay as they are. When saved-tensor hooks are
already active around the module (activation checkpointing, which then recomputes the gather itself), the module
leaves them alone.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from torchpre.parallel.saved_tensors import active_table, local_tensor, outer_hooks_active, rebuilt_saves


class SaveShardForBackward(ParallelStyle):
    """Applied after the module's `PrepareModuleInput` (whose pre-hook gathers the first input over the sequence):
    its forward saves the shard of that input, not the gathered tensor, and backward gathers it again."""

    def __init__(self, sequence_dim: int = 1) -> None:
        super().__init__()
        self.sequence_dim = sequence_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        hooks = _ModuleHooks(device_mesh, self.sequence_dim)
        module.register_forward_pre_hook(hooks.keep_shard, prepend=True)  # before the gather
        rebuilt_saves(module)
        module.register_forward_pre_hook(hooks.register)  # after the gather and `rebuilt_saves`' table
        return module


class _ModuleHooks:
    """One module's hooks: `keep_shard` keeps each forward's input shard before the gather, `register` registers
    the gathered input in the forward's table as rebuilt from that shard."""

    def __init__(self, mesh: DeviceMesh, sequence_dim: int) -> None:
        self.mesh, self.sequence_dim = mesh, sequence_dim
        self.shard: Tensor | None = None

    def keep_shard(self, module: nn.Module, args: tuple) -> None:
        if torch.is_grad_enabled() and not outer_hooks_active():
            self.shard = local_tensor(args[0]).detach()

    def register(self, module: nn.Module, args: tuple) -> None:
        shard, self.shard = self.shard, None
        table, gathered = active_table(), local_tensor(args[0])
        if table is None or shard is None or gathered.shape[self.sequence_dim] == shard.shape[self.sequence_dim]:
            return  # no backward, outer hooks, or nothing gathered here
        table.register(args[0], _Gather(shard, self.mesh, self.sequence_dim))


class _Gather:
    """The gathered input again, from its shard."""

    def __init__(self, shard: Tensor, mesh: DeviceMesh, sequence_dim: int) -> None:
        self.shard, self.mesh, self.sequence_dim = shard, mesh, sequence_dim

    def __call__(self) -> Tensor:
        shard = DTensor.from_local(self.shard, self.mesh, [Shard(self.sequence_dim)], run_check=False)
        return shard.redistribute(self.mesh, [Replicate()]).to_local()
