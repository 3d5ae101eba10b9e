"""`build_optimizer`: the distributed optimizer of a parallel model, for any registered torch optimizer."""

import functools

from torch import nn

from torchpre.config.job_config import Optimizer
from torchpre.distributed.names import canonical_fqn
from torchpre.optim.distributed_optimizer import DistributedOptimizer
from torchpre.optim.muon import hidden_matrices
from torchpre.optim.param_scales import ParamScales
from torchpre.optim.registry import (
    DEFAULT_HYPERPARAMETERS,
    constructor_kwargs,
    get_optimizer,
    hyperparameters_from_config,
)
from torchpre.parallel.api import ParallelModel
from torchpre.parallel.data_parallel import DataParallel
from torchpre.parallel.grad_reduction import GradReduction, build_grad_reduction


def build_optimizer(
    model: ParallelModel,
    *,
    name: str = "AdamW",
    zero_stage: int = 0,
    data_parallel: DataParallel | None = None,
    reduction: GradReduction | None = None,
    max_norm: float = 1.0,
    implementation: str = "auto",
    vocab_size: int | None = None,
    scales: ParamScales | None = None,
    **hyperparameters: object,
) -> DistributedOptimizer:
    """The optimizer `name` (see `torchpre.optim.registry`) on fp32 masters for `model`, under the data-parallel
    strategy `data_parallel` (default: `DataParallel(zero_stage)`: state replicated (0) or sharded over DP (ZeRO-1),
    gradients too (ZeRO-2), parameters too (ZeRO-3, for a model FSDP sharded, whose fp32 parameters are the
    masters)). Its gradients come from `reduction` (default: `build_grad_reduction(model, data_parallel)`, which
    starts the ZeRO 0-2 DP reduction during `model.forward_backward`); its `step()` finishes them (DP reduction, TP
    partial sums, tied copies, clipping) first.

    `hyperparameters` (lr, weight_decay, betas, eps, momentum, muon_*: `registry.DEFAULT_HYPERPARAMETERS`) override
    the defaults; those the optimizer does not take are not passed to it. An optimizer that assembles whole
    matrices (Muon) needs `vocab_size`: Muon steps the hidden matrices (`muon.hidden_matrices`), AdamW the rest.
    `scales`: a parametrization's per-parameter factors on the lr, weight decay and eps (µP), None for one lr.
    """
    unknown = sorted(set(hyperparameters) - set(DEFAULT_HYPERPARAMETERS))
    if unknown:
        known = list(DEFAULT_HYPERPARAMETERS)
        raise TypeError(f"build_optimizer() got unknown hyperparameters {unknown}; it knows {known}")
    if reduction is None:
        reduction = build_grad_reduction(model, data_parallel or DataParallel(zero_stage=zero_stage))
    spec = get_optimizer(name)
    hyperparameters = {**DEFAULT_HYPERPARAMETERS, **hyperparameters}
    kwargs = constructor_kwargs(spec, hyperparameters)
    if spec.uses_fused(model.device, implementation):
        kwargs["fused"] = True
    elif implementation == "foreach":
        kwargs["foreach"] = True
    if spec.whole_matrices:
        if vocab_size is None:
            raise TypeError(f"build_optimizer(name='{name}') needs vocab_size, to keep the output layer in AdamW")
        kwargs["hidden"] = hidden_matrices(
            model.named_parameters(), vocab_size, kwargs.pop("muon_adamw_params"), embeddings(model.parts)
        )
    return DistributedOptimizer(
        reduction,
        build_inner=functools.partial(spec.cls, **kwargs),
        weight_decay=hyperparameters["weight_decay"],
        max_norm=max_norm,
        state_mesh=model.dp_mesh if reduction.strategy.shards_parameters else model.mesh["dp", "tp"],
        expert_state_mesh=model.expert_mesh["edp", "ep"] if model.expert_mesh is not None else None,
        whole_matrices=spec.whole_matrices,
        scales=scales,
    )


def embeddings(parts: list[nn.Module]) -> set[str]:
    """The names of the parameters of `nn.Embedding` modules in `parts`."""
    return {
        canonical_fqn(f"{module_name}.{name}" if module_name else name)
        for part in parts
        for module_name, module in part.named_modules()
        if isinstance(module, nn.Embedding)
        for name, _ in module.named_parameters(recurse=False)
    }


def build_optimizer_from_config(
    model: ParallelModel,
    reduction: GradReduction,
    section: Optimizer,
    max_norm: float,
    vocab_size: int,
    scales: ParamScales | None = None,
) -> DistributedOptimizer:
    """`build_optimizer` from the job's [optimizer] section (its name, implementation and the hyperparameters the
    optimizer reads) over `reduction`; `max_norm` is training.max_norm, `vocab_size` the model's, `scales` its
    parametrization's factors."""
    return build_optimizer(
        model,
        name=section.name,
        reduction=reduction,
        max_norm=max_norm,
        implementation=section.implementation,
        vocab_size=vocab_size,
        scales=scales,
        **hyperparameters_from_config(vars(section)),
    )
