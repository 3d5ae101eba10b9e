"""`build_optimizer`: the distributed optimizer of a parallel model, for any registered torch optimizer."""

import functools

from torchpre.distributed.collectives import DEFAULT_BUCKET_BYTES
from torchpre.optim.distributed_optimizer import DistributedOptimizer
from torchpre.optim.registry import constructor_kwargs, get_optimizer
from torchpre.parallel.api import ParallelModel


def build_optimizer(
    model: ParallelModel,
    *,
    name: str = "AdamW",
    zero_stage: int = 0,
    lr: float = 3e-4,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    weight_decay: float = 0.1,
    momentum: float = 0.0,
    max_norm: float = 1.0,
    accumulate_in_fp32: bool = True,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> DistributedOptimizer:
    """The optimizer `name` (see `torchpre.optim.registry`) on fp32 masters for `model`, its state replicated
    (zero_stage 0) or sharded over DP (ZeRO-1); its `step()` finalises the gradients (TP partial sums, tied
    copies, DP reduction, clipping) first. Hyperparameters the optimizer does not take are not passed to it."""
    spec = get_optimizer(name)
    hyperparameters = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "momentum": momentum}
    kwargs = constructor_kwargs(spec, hyperparameters)
    if spec.uses_fused(model.device):
        kwargs["fused"] = True
    return DistributedOptimizer(
        model.named_parameters(),
        zero_stage=zero_stage,
        state_mesh=model.mesh["dp", "tp"],
        dp_group=model.mesh["dp"].get_group(),
        tp_group=model.mesh["tp"].get_group(),
        pp_group=model.mesh["pp"].get_group(),
        expert_state_mesh=model.expert_mesh["edp", "ep"] if model.expert_mesh is not None else None,
        accumulate_in_fp32=accumulate_in_fp32,
        build_inner=functools.partial(spec.cls, **kwargs),
        weight_decay=weight_decay,
        max_norm=max_norm,
        bucket_bytes=bucket_bytes,
        tied=model.plan.tied_weights,
        tied_peer=model.tied_peer(),
    )
