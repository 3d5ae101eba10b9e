"""Gradient reduction: from the gradients backward leaves on this rank to the finished gradients of the shards it
steps, and from the stepped shards back to the parameters. Separate from the optimizer that steps in between
(Megatron's DDP / distributed-optimizer split), so a new optimizer, or a new reduction, is one change in one place.

Finishing a step's gradients means: the data-parallel sum (ZeRO 0-2: `GradBuckets`, started during backward; ZeRO-3:
FSDP2's reduce-scatter, done during backward; nothing for a data-parallel group of one), then the per-rank partial
sums over TP (norms under sequence parallel), then the two copies of a weight tied across pipeline stages. Both
later sums commute with the DP sum, and every TP and pp rank cuts its DP chunks alike, so doing them on the shards
is the same arithmetic on 1/dp of the data. The optimizer then takes the global norm, clips and steps on the result
(`torchpre.optim`).
"""

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from torchpre.distributed.collectives import all_gather_into, all_reduce_tensors
from torchpre.distributed.names import canonical_fqn
from torchpre.parallel.api import ParallelModel
from torchpre.parallel.data_parallel import DataParallel, ShardedParameter
from torchpre.parallel.grad_buckets import GradBuckets
from torchpre.parallel.pipeline import sync_tied_gradients
from torchpre.parallel.tensor_parallel import local_gradient


@dataclass(frozen=True)
class ReductionGroups:
    """The process groups a step's gradient sums run over. `dp`: the dense parameters' data-parallel group (ZeRO-3:
    dp_shard; HSDP's replicas are FSDP's business); `edp` and `ep`: expert-parallel experts' data-parallel and
    expert groups (None without experts); `tied`: the names of a weight tied across pipeline stages, and
    `tied_peer` the pp rank holding the copy this rank does not (None when one rank holds both)."""

    dp: dist.ProcessGroup
    tp: dist.ProcessGroup
    pp: dist.ProcessGroup
    edp: dist.ProcessGroup | None = None
    ep: dist.ProcessGroup | None = None
    tied: tuple[str, str] | None = None
    tied_peer: int | None = None

    @property
    def tied_copy(self) -> str | None:
        """The name of the second copy of a weight tied across pipeline stages (its gradient equals the first's
        once summed, so norms count it once); None when there is none."""
        return self.tied[1] if self.tied and self.tied_peer is not None else None


class GradReduction(Protocol):
    """What an optimizer needs of a gradient reduction; `params` are the parameters in the order of every list."""

    params: list[ShardedParameter]
    strategy: DataParallel
    groups: ReductionGroups
    grads_in_parameters: bool  # the gradients stay in the parameters' `.grad`, as backward leaves them

    def reduce(self) -> list[torch.Tensor]:
        """Ends the step's backward: each parameter's finished gradient of this rank's shard (fp32)."""

    def sync_parameters(self, shards: list[torch.Tensor]) -> None:
        """Writes the stepped fp32 shards (one per parameter) into the parameters."""

    def zero_(self) -> None:
        """Drops the step's gradients."""

    def grad_bytes(self) -> int:
        """Bytes of this rank's persistent gradient storage."""


class BucketedReduction:
    """ZeRO 0-2: the gradients go through flat buckets (`GradBuckets`), all-reduced or reduce-scattered over DP as
    backward produces them; updated shards come back by one all-gather per bucket (sharded state) or a copy of the
    fp32 masters into low-precision parameters (replicated state)."""

    grads_in_parameters = False

    def __init__(self, params: list[ShardedParameter], strategy: DataParallel, groups: ReductionGroups):
        self.params, self.strategy, self.groups = params, strategy, groups
        dense = [i for i, p in enumerate(params) if not p.expert]
        experts = [i for i, p in enumerate(params) if p.expert]
        domains = [(dense, groups.dp)] + ([(experts, groups.edp)] if experts else [])
        self.buckets = GradBuckets(params, domains, strategy)

    def reduce(self) -> list[torch.Tensor]:
        shards = [g.float() for g in self.buckets.finish()]
        partial = [g for g, is_partial in zip(shards, self.buckets.tp_partial) if is_partial]
        all_reduce_tensors(partial, self.groups.tp, self.strategy.bucket_bytes)
        _sync_tied(self.params, shards, self.groups, contiguous=True)
        return shards

    @torch.no_grad()
    def sync_parameters(self, shards: list[torch.Tensor]) -> None:
        if self.strategy.shards_optimizer_state:
            # One all-gather per gradient bucket: its layout is that of the shards too.
            for bucket in self.buckets.buckets:
                members = [self.params[i] for i in bucket.members]
                outputs = [p.local for p in members]
                all_gather_into(bucket.layout, [shards[i] for i in bucket.members], outputs, bucket.group)
            return
        _copy_into_low_precision(self.params, shards)

    def zero_(self) -> None:
        self.buckets.zero_()

    def grad_bytes(self) -> int:
        return self.buckets.grad_bytes()

    def local_gradients(self) -> list[torch.Tensor]:
        """Every parameter's accumulated local gradient in fp32 before the DP reduction (zeros for one that got
        none), for tests: valid while no bucket was reduced (dp 1, or backward not run by `forward_backward`)."""
        return self.buckets.local_gradients()


class LocalReduction:
    """A data-parallel group of one (every parameter's): no buckets and no hooks. Autograd accumulates each
    gradient in the parameter's own `.grad` across microbatches, in the parameter's dtype, which is then the
    accumulation dtype (fp32, or bf16 when `accumulate_in_fp32` is off), and `reduce` takes those: the same sums as
    the buckets' (there is nothing to reduce over DP), without copying every gradient into a flat buffer from a
    Python hook, microbatch after microbatch. TP partial sums and tied copies are finished as in `BucketedReduction`.

    `eligible` says when it applies; `build_grad_reduction` picks it then."""

    grads_in_parameters = True

    def __init__(self, params: list[ShardedParameter], strategy: DataParallel, groups: ReductionGroups):
        self.params, self.strategy, self.groups = params, strategy, groups

    @staticmethod
    def eligible(params: list[ShardedParameter], strategy: DataParallel, groups: ReductionGroups) -> bool:
        """Every gradient's DP group has one rank and accumulates in its parameter's own dtype."""
        single = [groups.dp] + ([groups.edp] if any(p.expert for p in params) else [])
        same_dtype = all(p.local.dtype == torch.float32 or not strategy.accumulate_in_fp32 for p in params)
        return not strategy.shards_parameters and all(dist.get_world_size(g) == 1 for g in single) and same_dtype

    @torch.no_grad()
    def reduce(self) -> list[torch.Tensor]:
        shards, partial = [], []
        for p in self.params:
            if p.param.grad is None:  # no gradient this step: a zero one, as the buckets hold
                grad = torch.zeros_like(p.local)
            else:
                grad, is_partial = local_gradient(p.param, p.param.grad)
                if is_partial:
                    partial.append(grad)
            shards.append(grad.float())
        all_reduce_tensors(partial, self.groups.tp, self.strategy.bucket_bytes)
        _sync_tied(self.params, shards, self.groups, contiguous=True)
        return shards

    @torch.no_grad()
    def sync_parameters(self, shards: list[torch.Tensor]) -> None:
        _copy_into_low_precision(self.params, shards)

    def zero_(self) -> None:
        for p in self.params:
            p.param.grad = None

    def grad_bytes(self) -> int:
        """The gradients autograd keeps in `.grad` from the first backward to the step, shaped like the
        parameters' local tensors and in their dtype."""
        return sum(p.local.nbytes for p in self.params)

    def local_gradients(self) -> list[torch.Tensor]:
        """Every parameter's accumulated gradient in fp32 (zeros for one that got none), for tests."""
        return [
            (local_gradient(p.param, p.param.grad)[0] if p.param.grad is not None else torch.zeros_like(p.local))
            .float()
            for p in self.params
        ]


class FSDPReduction:
    """ZeRO-3: FSDP2 reduce-scatters each block's gradients over dp_shard during backward (and all-reduces them over
    dp_replicate under HSDP), summing TP partial sums on the way. What is left: a zero gradient for a parameter
    that got none (the other stages step on zeros too) and the tied copies. The parameters are the optimizer's
    masters, so nothing is written back: FSDP gathers the new values at the next forward."""

    grads_in_parameters = True

    def __init__(self, params: list[ShardedParameter], strategy: DataParallel, groups: ReductionGroups):
        self.params, self.strategy, self.groups = params, strategy, groups

    @torch.no_grad()
    def reduce(self) -> list[torch.Tensor]:
        for p in self.params:
            if p.param.grad is None:
                p.param.grad = torch.zeros_like(p.param)
        shards = [p.param.grad.to_local() for p in self.params]
        _sync_tied(self.params, shards, self.groups, contiguous=False)
        return shards

    def sync_parameters(self, shards: list[torch.Tensor]) -> None:
        """Nothing to write: the parameters are the masters."""

    def zero_(self) -> None:
        for p in self.params:
            p.param.grad = None

    def grad_bytes(self) -> int:
        """Fp32 gradient shards shaped like the parameter shards, between backward and the update."""
        return sum(p.param.to_local().nbytes for p in self.params)


def build_grad_reduction(model: ParallelModel, strategy: DataParallel) -> GradReduction:
    """The reduction of `model`'s gradients under `strategy`, its parameters in `model.named_parameters()` order.
    With `strategy.overlap_grad_reduce` the ZeRO 0-2 buckets start their collectives during
    `model.forward_backward` (they are registered as its backward callback)."""
    if strategy.shards_parameters and model.dp_mesh is None:
        raise ValueError("ZeRO-3 needs a model sharded by FSDP: parallelize(..., dp_mesh=...) with plan.fsdp")
    named = model.named_parameters()
    part_of = {name: i for i, part in enumerate(model.parts) for name, _ in _canonical_names(part)}
    dp_mesh = model.dp_mesh["dp_shard"] if strategy.shards_parameters else model.mesh["dp"]
    expert_groups = _expert_groups(model, strategy)
    groups = ReductionGroups(
        dp=dp_mesh.get_group(),
        tp=model.mesh["tp"].get_group(),
        pp=model.mesh["pp"].get_group(),
        edp=expert_groups[0],
        ep=expert_groups[1],
        tied=model.plan.tied_weights,
        tied_peer=model.tied_peer(),
    )
    params = strategy.shard_parameters(named, groups.dp, groups.edp, [part_of[name] for name, _ in named])
    if strategy.shards_parameters:
        return FSDPReduction(params, strategy, groups)
    if LocalReduction.eligible(params, strategy, groups):
        return LocalReduction(params, strategy, groups)
    reduction = BucketedReduction(params, strategy, groups)
    model.set_backward_callback(reduction.buckets.on_backward)
    return reduction


def _canonical_names(part: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(canonical_fqn(name), param) for name, param in part.named_parameters()]


def _expert_groups(
    model: ParallelModel, strategy: DataParallel
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(edp, ep) of the expert-parallel experts: ZeRO 0-2 from the expert mesh, ZeRO-3 from the experts' own FSDP
    mesh (edp_shard); (None, None) without experts."""
    if strategy.shards_parameters:
        experts = [
            p for _, p in model.named_parameters()
            if isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ())
        ]
        if not experts:
            return None, None
        mesh = experts[0].device_mesh
        return mesh["edp_shard"].get_group(), mesh["ep"].get_group()
    if model.expert_mesh is None:
        return None, None
    return model.expert_mesh["edp"].get_group(), model.expert_mesh["ep"].get_group()


def _copy_into_low_precision(params: list[ShardedParameter], shards: list[torch.Tensor]) -> None:
    """Replicated state: the fp32 masters of low-precision parameters written back in one foreach copy (an fp32
    parameter's master is a view of it already)."""
    owned = [(p.local, shard) for p, shard in zip(params, shards) if shard.dtype != p.local.dtype]
    if owned:
        torch._foreach_copy_([local for local, _ in owned], [shard for _, shard in owned])


def _sync_tied(
    params: list[ShardedParameter], shards: list[torch.Tensor], groups: ReductionGroups, contiguous: bool
) -> None:
    """Sums the gradients of the two copies of a weight tied across pipeline stages (`sync_tied_gradients`), on
    their DP shards; `contiguous`: the shards may be strided views, sent as contiguous copies."""
    if not groups.tied or groups.tied_peer is None:
        return
    held = {p.name: shard for p, shard in zip(params, shards) if p.name in groups.tied}
    if not contiguous:
        sync_tied_gradients(held, groups.tied, groups.tied_peer, groups.pp)
        return
    dense = {name: shard.contiguous() for name, shard in held.items()}
    sync_tied_gradients(dense, groups.tied, groups.tied_peer, groups.pp)
    for name, shard in held.items():
        if dense[name] is not shard:
            shard.copy_(dense[name])
