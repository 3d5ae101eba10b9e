"""`build_optimizer`: the distributed optimizer of a parallel model, for any registered torch optimizer."""

import functools

import torch

from torchpre.distributed.collectives import DEFAULT_BUCKET_BYTES
from torchpre.distributed.names import canonical_fqn
from torchpre.optim.distributed_optimizer import DistributedOptimizer
from torchpre.optim.fsdp_optimizer import FullyShardedOptimizer
from torchpre.optim.registry import DEFAULT_HYPERPARAMETERS, constructor_kwargs, get_optimizer
from torchpre.parallel.api import ParallelModel


def build_optimizer(
    model: ParallelModel,
    *,
    name: str = "AdamW",
    zero_stage: int = 0,
    max_norm: float = 1.0,
    accumulate_in_fp32: bool = True,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    reduce_dtype: torch.dtype = torch.float32,
    overlap_grad_reduce: bool = True,
    zero2_accumulate_locally: bool = False,
    implementation: str = "auto",
    **hyperparameters: object,
) -> DistributedOptimizer:
    """The optimizer `name` (see `torchpre.optim.registry`) on fp32 masters for `model`, its state replicated
    (zero_stage 0) or sharded over DP (ZeRO-1), its gradients too (ZeRO-2); ZeRO-3 for a model FSDP sharded, whose
    fp32 parameters are the masters. Its `step()` finalises the gradients (DP reduction, TP partial sums, tied
    copies, clipping) first. With `overlap_grad_reduce` the ZeRO 0-2 DP reduction starts during
    `model.forward_backward` (the optimizer registers its buckets as the model's backward callback).

    `hyperparameters` (lr, weight_decay, betas, eps, momentum: `registry.DEFAULT_HYPERPARAMETERS`) override the
    defaults; those the optimizer does not take are not passed to it.
    """
    unknown = sorted(set(hyperparameters) - set(DEFAULT_HYPERPARAMETERS))
    if unknown:
        known = list(DEFAULT_HYPERPARAMETERS)
        raise TypeError(f"build_optimizer() got unknown hyperparameters {unknown}; it knows {known}")
    spec = get_optimizer(name)
    hyperparameters = {**DEFAULT_HYPERPARAMETERS, **hyperparameters}
    kwargs = constructor_kwargs(spec, hyperparameters)
    if spec.uses_fused(model.device, implementation):
        kwargs["fused"] = True
    elif implementation == "foreach":
        kwargs["foreach"] = True
    fsdp = zero_stage == 3
    if fsdp and model.dp_mesh is None:
        raise ValueError("zero_stage 3 needs a model sharded by FSDP: parallelize(..., dp_mesh=...) with plan.fsdp")
    named = model.named_parameters()
    part_of = {canonical_fqn(name): i for i, part in enumerate(model.parts) for name, _ in part.named_parameters()}
    optimizer = (FullyShardedOptimizer if fsdp else DistributedOptimizer)(
        named,
        zero_stage=zero_stage,
        state_mesh=model.dp_mesh if fsdp else model.mesh["dp", "tp"],
        dp_group=(model.dp_mesh["dp_shard"] if fsdp else model.mesh["dp"]).get_group(),
        tp_group=model.mesh["tp"].get_group(),
        pp_group=model.mesh["pp"].get_group(),
        expert_state_mesh=model.expert_mesh["edp", "ep"] if model.expert_mesh is not None else None,
        accumulate_in_fp32=accumulate_in_fp32,
        build_inner=functools.partial(spec.cls, **kwargs),
        weight_decay=hyperparameters["weight_decay"],
        max_norm=max_norm,
        bucket_bytes=bucket_bytes,
        tied=model.plan.tied_weights,
        tied_peer=model.tied_peer(),
        parts=[part_of[name] for name, _ in named],
        reduce_dtype=reduce_dtype,
        overlap_grad_reduce=overlap_grad_reduce,
        zero2_accumulate_locally=zero2_accumulate_locally,
    )
    if optimizer.buckets is not None:
        model.set_backward_callback(optimizer.buckets.on_backward)
    return optimizer
