"""ZeRO-3 with PyTorch's FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded over DP.

FSDP2 is the engine; this module only decides where its groups go. Each block is one FSDP group (its
parameters are all-gathered before its forward and backward and its gradients reduce-scattered after its
backward), and the part root is another one, which collects what no block holds: embeddings, the final norm,
the head, and a weight tied between them (a Parameter belongs to exactly one FSDP group).

The sharded fp32 parameters are the optimizer's masters (`MixedPrecisionPolicy` casts them to the compute
dtype at each all-gather). Gradients are summed, not averaged: the trainer's loss is already divided by the
global token count, so FSDP's default division by the data-parallel degree would divide twice.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard


@dataclass(frozen=True)
class FSDPPlan:
    """How `apply_fsdp` shards a part: `param_dtype` is the compute dtype of the gathered parameters (None:
    their own, fp32), `reduce_dtype` that of the gradient reduction, and `reshard_after_forward` whether a
    block frees its gathered parameters after its forward (and gathers them again for backward).

    Under pipeline parallelism a stage runs forward and backward once per microbatch, so resharding after
    forward costs one extra all-gather per block and microbatch; torch's pipeline stage also keeps the
    gathered parameters through every backward of the step (it reduce-scatters once, after the last).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype = torch.float32
    reshard_after_forward: bool = True


def apply_fsdp(
    part: nn.Module,
    dp_mesh: DeviceMesh,
    plan: FSDPPlan,
    blocks: nn.Module | None,
    expert_dp_mesh: DeviceMesh | None = None,
) -> list[FSDPModule]:
    """Shards `part` (a model or one pipeline stage) in place over `dp_mesh`: the expert-parallel experts over
    `expert_dp_mesh`, then each entry of its `blocks` container (if any), then the part itself. Returns the FSDP
    modules, outermost last.

    `dp_mesh` is 1-D (dp_shard: FSDP) or 2-D (dp_replicate, dp_shard: HSDP, which replicates over the first
    dim and shards over the second); `expert_dp_mesh` likewise with edp_shard, the ranks of dp_shard that hold
    the same experts. Blocks are sharded as they are in the container, i.e. around an activation-checkpoint
    wrapper or a compiled module, so FSDP's hooks run outside both.
    """
    policy = MixedPrecisionPolicy(param_dtype=plan.param_dtype, reduce_dtype=plan.reduce_dtype)
    options = {"mp_policy": policy, "reshard_after_forward": plan.reshard_after_forward}
    sharded = []
    if expert_dp_mesh is not None:
        shard_dim = _expert_shard_dim(expert_dp_mesh)
        for experts in expert_parallel_modules(part):
            sharded.append(fully_shard(experts, mesh=expert_dp_mesh, shard_placement_fn=shard_dim, **options))
    if blocks is not None:
        sharded += [fully_shard(block, mesh=dp_mesh, **options) for block in blocks.children()]
    sharded.append(fully_shard(part, mesh=dp_mesh, **options))
    for module in sharded:
        sum_gradients(module)
    # TODO(perf): explicit prefetching (`set_modules_to_forward_prefetch` / `set_modules_to_backward_prefetch`,
    # as torchtitan's llama4 apply_fsdp does) overlaps more all-gathers; correctness does not need it.
    return sharded


def expert_parallel_modules(part: nn.Module) -> list[nn.Module]:
    """The modules whose own parameters expert parallelism placed on the ep mesh (grouped experts)."""
    return [
        module
        for module in part.modules()
        if any(
            isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ())
            for p in module.parameters(recurse=False)
        )
    ]


def _expert_shard_dim(expert_dp_mesh: DeviceMesh) -> Callable[[nn.Parameter], Shard]:
    """Experts' weights [local experts, ...] are sharded over their local experts when every edp_shard rank gets
    the same number of them, else along their second dimension (torchtitan shards more ranks than experts so)."""
    ranks = expert_dp_mesh.size(-1)

    def placement(param: nn.Parameter) -> Shard:
        local = param.to_local() if isinstance(param, DTensor) else param
        return Shard(0) if local.shape[0] % ranks == 0 else Shard(1)

    return placement


def sum_gradients(module: FSDPModule) -> None:
    """Makes FSDP sum gradients over DP instead of averaging them, with plain SUM collectives (gloo has no
    AVG or PREMUL_SUM; a factor of 1 needs no scaling on any backend)."""
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)
