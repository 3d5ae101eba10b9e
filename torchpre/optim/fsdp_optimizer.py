"""The optimizer of a model sharded by FSDP2 (ZeRO-3, `torchpre.parallel.data_parallel`).

FSDP2 already does what ZeRO 0-2 do by hand: its parameters are fp32 DTensors sharded over DP (they are the
masters; the compute copies are cast at each all-gather), and it reduce-scatters each block's gradients over
dp_shard (and all-reduces them over dp_replicate under HSDP) during backward, summing TP partial sums on the
way. What is left for this class is what the other stages do after the DP reduction, with the same code:
summing the two copies of a weight tied across pipeline stages, the global norm, clipping, the non-finite
guard's `discard`. The inner optimizer steps the FSDP parameters themselves, so its state tensors are DTensors
with FSDP's placements, which checkpoints save and reshard as they are.

Memory per parameter (bytes), AdamW: parameters 4/dp_shard, gradients 4/dp_shard, state 8/dp_shard, plus the
gathered compute copies of the blocks being run.
"""

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from torchpre.errors import ConfigError
from torchpre.optim.distributed_optimizer import DistributedOptimizer, _Entry
from torchpre.parallel.pipeline import sync_tied_gradients


class FullyShardedOptimizer(DistributedOptimizer):
    """`DistributedOptimizer` at ZeRO stage 3: each entry's master is its FSDP parameter (an fp32 DTensor
    sharded over dp_shard, and over tp under TP; expert-parallel experts over edp_shard and ep); `dp_group` is
    the dp_shard group (gradients are replicated over dp_replicate under HSDP, so the norm sums squares over
    dp_shard only)."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], **kwargs) -> None:
        super().__init__(named_params, **kwargs)
        experts = [entry.param for entry in self.entries if entry.expert]
        if experts:  # their squares are summed over the ranks holding other experts and other shards of them
            mesh = experts[0].device_mesh
            self.edp_group, self.ep_group = mesh["edp_shard"].get_group(), mesh["ep"].get_group()

    def _entry(self, name: str, param: nn.Parameter) -> _Entry:
        if not isinstance(param, DTensor) or param.dtype != torch.float32:
            raise ConfigError(
                f"optimizer.zero_stage = 3 expects '{name}' to be an fp32 parameter sharded by FSDP (fully_shard), "
                f"got a {type(param).__name__} of {param.dtype}: build the model in fp32 and pass a ParallelPlan "
                "with fsdp to parallelize."
            )
        _check_checkpointable(name, param)
        names = param.device_mesh.mesh_dim_names or ()
        tp_sharded = "tp" in names and isinstance(param.placements[names.index("tp")], Shard)
        # The parameter is its own master and "local" tensor: FSDP may swap its local tensor at lazy init.
        return _Entry(name, param, param, tp_sharded, 0, param, expert="ep" in names)

    @torch.no_grad()
    def reduce_gradients(self) -> torch.Tensor:
        """Finalises the gradients FSDP reduced over DP (tied copies summed over pp, the global norm, clipping,
        all in place on the local shards of the DTensor gradients) and returns the norm before clipping."""
        for entry in self.entries:
            if entry.param.grad is None:  # no gradient this step: a zero one, as the other stages step on
                entry.param.grad = torch.zeros_like(entry.param)
        shards = [entry.param.grad.to_local() for entry in self.entries]
        if self.tied and self.tied_peer is not None:
            by_name = {e.name: g for e, g in zip(self.entries, shards) if e.name in self.tied}
            sync_tied_gradients(by_name, self.tied, self.tied_peer, self.pp_group)
        return self._finalise(shards, sharded_over_dp=True)

    def _set_master_grads(self, shards: list[torch.Tensor]) -> None:
        """The shards are the local tensors of the parameters' own gradients, already clipped in place."""

    def apply(self, skip: torch.Tensor | None = None) -> None:
        """Steps the inner optimizer on the FSDP parameters; FSDP gathers the new values at the next forward."""
        self._step_inner(skip)
        self._zero_grads()

    def _zero_grads(self) -> None:
        for entry in self.entries:
            entry.param.grad = None

    def parameters_from_masters(self) -> None:
        """Nothing to write: the parameters are the masters."""

    def masters(self) -> dict[str, DTensor]:
        return {entry.name: entry.param for entry in self.entries}

    def _as_dtensor(self, entry: _Entry, local: torch.Tensor) -> DTensor:
        """State tensors of a DTensor parameter are DTensors with its placements already."""
        return local

    def state_bytes(self) -> int:
        """Bytes of the inner optimizer's state on this rank (AdamW: its moments' local shards and its step
        counts, as the other stages count them; there are no separate masters)."""
        return sum(
            (v.to_local() if isinstance(v, DTensor) else v).nbytes
            for state in self.inner.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor)
        )

    def param_bytes(self) -> int:
        """Bytes of this rank's sharded fp32 parameters (the gathered compute copies are transient)."""
        return sum(entry.param.to_local().nbytes for entry in self.entries)

    def grad_bytes(self) -> int:
        """Bytes of this rank's sharded gradients between backward and the update: fp32, shaped like the
        parameter shards, whatever FSDP's reduce dtype."""
        return self.param_bytes()


def _check_checkpointable(name: str, param: DTensor) -> None:
    """FSDP shards a dimension TP already shards (a column-parallel bias) as `_StridedShard`, which DCP cuts
    unlike FSDP's torch.chunk when the size is not divisible by both degrees: a reshard would move values."""
    strided = [p for p in param.placements if isinstance(p, _StridedShard)]
    if not strided:
        return
    dim = strided[0].dim
    ranks = 1
    for size, placement in zip(param.device_mesh.shape, param.placements):
        if isinstance(placement, Shard) and placement.dim == dim:
            ranks *= size
    if param.shape[dim] % ranks:
        raise ConfigError(
            f"The ZeRO-3 shards of '{name}' cannot be checkpointed: its size along dim {dim} ({param.shape[dim]}), "
            f"which tensor parallelism shards, is not divisible by data_parallel_shard_degree x tp = {ranks}. Use "
            "optimizer.zero_stage = 0 or 1, or a data-parallel degree that divides it."
        )
