"""The distributed optimizer over a plain module's parameters (no `ParallelModel`), as tests build it: the
data-parallel strategy shards the parameters, a bucketed reduction reduces their gradients over `dp_group`, and the
optimizer steps on the result."""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchpre.optim.distributed_optimizer import DistributedOptimizer
from torchpre.parallel.data_parallel import DataParallel
from torchpre.parallel.grad_reduction import BucketedReduction, ReductionGroups


def plain_optimizer(
    named_params: list[tuple[str, nn.Parameter]],
    *,
    zero_stage: int,
    dp_group: dist.ProcessGroup,
    tp_group: dist.ProcessGroup,
    pp_group: dist.ProcessGroup,
    build_inner: Callable[[list[dict]], torch.optim.Optimizer],
    weight_decay: float,
    max_norm: float,
    state_mesh: DeviceMesh | None = None,
    accumulate_in_fp32: bool = True,
    **strategy: object,
) -> DistributedOptimizer:
    data_parallel = DataParallel(zero_stage=zero_stage, accumulate_in_fp32=accumulate_in_fp32, **strategy)
    params = data_parallel.shard_parameters(named_params, dp_group)
    reduction = BucketedReduction(params, data_parallel, ReductionGroups(dp=dp_group, tp=tp_group, pp=pp_group))
    return DistributedOptimizer(
        reduction, build_inner=build_inner, weight_decay=weight_decay, max_norm=max_norm, state_mesh=state_mesh
    )


@dataclass(frozen=True)
class Entry:
    """One parameter as the optimizer holds it: its data-parallel description and its fp32 master."""

    name: str
    param: nn.Parameter
    local: torch.Tensor
    dim: int
    master: torch.Tensor
    owns_master: bool


def entries(optimizer: DistributedOptimizer) -> list[Entry]:
    """`optimizer`'s parameters in its order (that of `reduction.local_gradients()`)."""
    return [
        Entry(p.name, p.param, p.local, p.dim, master, optimizer.owns_master(i))
        for i, (p, master) in enumerate(zip(optimizer.params, optimizer.masters))
    ]
