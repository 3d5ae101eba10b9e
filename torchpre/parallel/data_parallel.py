"""Data parallelism as one strategy object: what ZeRO shards (optimizer state, gradients, parameters), how the
gradients are reduced, and, for ZeRO-3, PyTorch's FSDP2 (`fully_shard`) as the engine.

`DataParallel` is built once from the config and asked by capability (`shards_optimizer_state`,
`shards_gradients`, `shards_parameters`); nothing outside this module tests the stage number. `shard_parameters`
describes every parameter as data parallelism splits it on this rank (`ShardedParameter`): the gradient reduction
(`torchpre.parallel.grad_reduction`) and the optimizer that steps on the shards (`torchpre.optim`) both read it.

Under ZeRO-3 each block is one FSDP group (its parameters are all-gathered before its forward and backward and its
gradients reduce-scattered after its backward; with `parallelism.fsdp_wrap = "sublayer"` its attention and
feed-forward are groups of their own inside it), and the part root is another one, which collects what no block
holds: embeddings, the final norm, the head, and a weight tied between them (a Parameter belongs to exactly one FSDP
group). The sharded fp32 parameters are the optimizer's masters (`MixedPrecisionPolicy` casts them to the compute
dtype at each all-gather). Gradients are summed, not averaged: the trainer's loss is already divided by the global
token count, so FSDP's default division by the data-parallel degree would divide twice.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from torchpre.config.job_config import JobConfig
from torchpre.distributed.collectives import DEFAULT_BUCKET_BYTES, rank_chunk
from torchpre.errors import ConfigError
from torchpre.step_rules.zero_stages import ZeroStage, zero_stage


@dataclass(frozen=True)
class DataParallel:
    """How data parallelism shards the training state and reduces gradients: ZeRO stage `zero_stage`
    (`torchpre.step_rules.zero_stages`), asked by capability, and the reduction's settings.

    | zero_stage | optimizer state | gradients | parameters | gradient reduction |
    |---|---|---|---|---|
    | 0 | replicated | replicated | replicated | all-reduce of flat buckets |
    | 1 | sharded | replicated (each rank keeps its sum) | replicated | reduce-scatter of flat buckets |
    | 2 | sharded | sharded | replicated | reduce-scatter into the gradient shard |
    | 3 | sharded | sharded | sharded (FSDP2) | FSDP2's reduce-scatter per block |

    `reduce_dtype` is the dtype of the reduction's collectives; `bucket_bytes` the size of ZeRO 0-2's flat buckets;
    `overlap_grad_reduce` starts each bucket's reduction during backward; `accumulate_locally` (ZeRO-2) sums the
    microbatches in a full fp32 buffer and reduce-scatters once; `accumulate_in_fp32` sums microbatch gradients in
    fp32 whatever the parameters' dtype (False only to measure the error of bf16 accumulation).
    """

    zero_stage: int = 0
    reduce_dtype: torch.dtype = torch.float32
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    overlap_grad_reduce: bool = True
    accumulate_locally: bool = False
    accumulate_in_fp32: bool = True
    stage: ZeroStage = field(init=False, repr=False, compare=False)  # `zero_stage`'s row, resolved once

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage", zero_stage(self.zero_stage))  # an unknown stage names the valid ones

    @classmethod
    def from_config(cls, config: JobConfig) -> "DataParallel":
        """The strategy of `config.optimizer` (zero_stage, reduce_dtype, bucket_size_mb, overlap_grad_reduce,
        zero2_accumulate_locally) and `training.mixed_precision_grad`, whose combinations `validate_config` checked
        (`torchpre.config.validate`)."""
        o, t = config.optimizer, config.training
        return cls(
            zero_stage=o.zero_stage,
            reduce_dtype=getattr(torch, o.reduce_dtype),
            bucket_bytes=int(o.bucket_size_mb * 2**20),
            overlap_grad_reduce=o.overlap_grad_reduce,
            accumulate_locally=o.zero2_accumulate_locally,
            accumulate_in_fp32=t.mixed_precision_grad == "float32",
        )

    @property
    def shards_optimizer_state(self) -> bool:
        """Each DP rank keeps the optimizer state (and fp32 masters) of its chunk of every parameter only."""
        return self.stage.shards_optimizer_state

    @property
    def shards_gradients(self) -> bool:
        """Each DP rank keeps the reduced gradient of its chunk only (ZeRO-2's transient buckets, FSDP's shards)."""
        return self.stage.shards_gradients

    @property
    def shards_parameters(self) -> bool:
        """The parameters themselves are sharded, by FSDP2 (ZeRO-3): they are the optimizer's fp32 masters."""
        return self.stage.shards_parameters

    @property
    def reduces_each_microbatch(self) -> bool:
        """Sharded gradients kept by torchpre's buckets (ZeRO-2) with overlap: every microbatch's gradients are
        reduce-scattered into the shard as backward produces them, unless `accumulate_locally` sums the
        microbatches first (as ZeRO-1 does)."""
        sharded = self.shards_gradients and not self.shards_parameters
        return sharded and self.overlap_grad_reduce and not self.accumulate_locally

    def shard_parameters(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        dp_group: dist.ProcessGroup,
        edp_group: dist.ProcessGroup | None = None,
        parts: list[int] | None = None,
    ) -> list["ShardedParameter"]:
        """Each parameter as this strategy splits it on this rank (`parts[i]`: the pipeline part of the i-th).
        ZeRO 0-2 shard (when they shard) over `dp_group`, or `edp_group` for expert-parallel experts; ZeRO-3
        parameters are FSDP's DTensors already."""
        parts = parts or [0] * len(named_params)
        if self.shards_parameters:
            return [_fsdp_parameter(name, param, part) for (name, param), part in zip(named_params, parts)]
        return [
            _replicated_parameter(name, param, part, dp_group, edp_group, self.shards_optimizer_state)
            for (name, param), part in zip(named_params, parts)
        ]


@dataclass(eq=False)
class ShardedParameter:
    """One model parameter as data parallelism splits it on this rank.

    `local` is the parameter's local (TP/EP) tensor, sharing its storage (under ZeRO-3 the FSDP DTensor itself);
    `shard` the part of it whose optimizer state this rank keeps: its `torch.chunk` of `local` along `dim` (the
    first dimension TP does not shard) over its DP group when the state is sharded, else `local` (ZeRO-3: the
    parameter, which FSDP shards). `expert`: sharded by expert parallelism, so reduced and sharded over the
    expert-data-parallel group `edp` instead of `dp`. `part`: the index of its pipeline part in the model.
    """

    name: str
    param: nn.Parameter
    local: torch.Tensor
    shard: torch.Tensor
    dim: int
    tp_sharded: bool
    expert: bool = False
    part: int = 0


def _replicated_parameter(
    name: str,
    param: nn.Parameter,
    part: int,
    dp_group: dist.ProcessGroup,
    edp_group: dist.ProcessGroup | None,
    shards_state: bool,
) -> ShardedParameter:
    with torch.no_grad():
        local = param.to_local() if isinstance(param, DTensor) else param.data
    sharded = {p.dim for p in param.placements if isinstance(p, Shard)} if isinstance(param, DTensor) else set()
    expert = isinstance(param, DTensor) and param.device_mesh.mesh_dim_names == ("ep",)
    dim = next((d for d in range(local.ndim) if d not in sharded), 0)
    shard = local
    if shards_state:
        group = edp_group if expert else dp_group
        shard = rank_chunk(local, dim, dist.get_world_size(group), dist.get_rank(group))
    return ShardedParameter(name, param, local, shard, dim, bool(sharded) and not expert, expert, part)


def _fsdp_parameter(name: str, param: nn.Parameter, part: int) -> ShardedParameter:
    if not isinstance(param, DTensor) or param.dtype != torch.float32:
        raise ConfigError(
            f"optimizer.zero_stage = 3 expects '{name}' to be an fp32 parameter sharded by FSDP (fully_shard), "
            f"got a {type(param).__name__} of {param.dtype}: build the model in fp32 and pass a ParallelPlan "
            "with fsdp to parallelize."
        )
    _check_checkpointable(name, param)
    names = param.device_mesh.mesh_dim_names or ()
    tp_sharded = "tp" in names and isinstance(param.placements[names.index("tp")], Shard)
    # The parameter is its own local tensor and shard: FSDP may swap its local tensor at lazy init.
    return ShardedParameter(name, param, param, param, 0, tp_sharded, expert="ep" in names, part=part)


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


@dataclass(frozen=True)
class FSDPPlan:
    """How `apply_fsdp` shards a part: `param_dtype` is the compute dtype of the gathered parameters (None:
    their own, fp32), `reduce_dtype` that of the gradient reduction, and `reshard_after_forward` whether a
    block frees its gathered parameters after its forward (and gathers them again for backward).

    Under pipeline parallelism a stage runs forward and backward once per microbatch, so resharding after
    forward costs one extra all-gather per block and microbatch; torch's pipeline stage also keeps the
    gathered parameters through every backward of the step (it reduce-scatters once, after the last).

    `sublayers` (`parallelism.fsdp_wrap = "sublayer"`) names the children of a block (its attention and
    feed-forward) that are FSDP units of their own inside the block's, which keeps the rest (its norms). FSDP2
    gathers one unit ahead of the one running (the next all-gather is issued before the current unit's output
    is freed, and backward prefetches the next unit in reverse order), so the gathered parameters at the peak
    are the largest two consecutive units': about one block's instead of two. Each unit is one all-gather
    and one reduce-scatter, so a block costs three of each instead of one.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype = torch.float32
    reshard_after_forward: bool = True
    byte_all_gather: bool = False  # gather 1-byte dtypes (FP8 all-gather) as uint8, which every backend has
    sublayers: tuple[str, ...] = ()  # a block's children sharded as units of their own (`apply_fsdp`)


class ByteAllGather(DefaultAllGather):
    """FSDP2's all-gather with 1-byte dtypes viewed as uint8: gloo has no FP8 types ("Invalid scalar type"), and the
    bytes are the same."""

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> dist.Work | None:
        if output_tensor.element_size() == 1:
            output_tensor, input_tensor = output_tensor.view(torch.uint8), input_tensor.view(torch.uint8)
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def apply_fsdp(
    part: nn.Module,
    dp_mesh: DeviceMesh,
    plan: FSDPPlan,
    blocks: Sequence[nn.Module] = (),
    expert_dp_mesh: DeviceMesh | None = None,
) -> list[FSDPModule]:
    """Shards `part` (a model or one pipeline stage) in place over `dp_mesh`: the expert-parallel experts over
    `expert_dp_mesh`, then each of its `blocks`, then the part itself. Returns the FSDP modules, outermost last.

    `dp_mesh` is 1-D (dp_shard: FSDP) or 2-D (dp_replicate, dp_shard: HSDP, which replicates over the first
    dim and shards over the second); `expert_dp_mesh` likewise with edp_shard, the ranks of dp_shard that hold
    the same experts. Blocks are sharded as they are in the part, i.e. around an activation-checkpoint
    wrapper or a compiled module, so FSDP's hooks run outside both.
    """
    policy = MixedPrecisionPolicy(param_dtype=plan.param_dtype, reduce_dtype=plan.reduce_dtype)
    options = {"mp_policy": policy, "reshard_after_forward": plan.reshard_after_forward}
    sharded = []
    if expert_dp_mesh is not None:
        shard_dim = _expert_shard_dim(expert_dp_mesh)
        for experts in expert_parallel_modules(part):
            sharded.append(fully_shard(experts, mesh=expert_dp_mesh, shard_placement_fn=shard_dim, **options))
    for block in blocks:
        sharded += [fully_shard(sublayer, mesh=dp_mesh, **options) for sublayer in _sublayers(block, plan.sublayers)]
        sharded.append(fully_shard(block, mesh=dp_mesh, **options))
    sharded.append(fully_shard(part, mesh=dp_mesh, **options))
    for module in sharded:
        sum_gradients(module)
        if plan.byte_all_gather:
            module.set_custom_all_gather(ByteAllGather())
    # TODO(perf): explicit prefetching (`set_modules_to_forward_prefetch` / `set_modules_to_backward_prefetch`,
    # as torchtitan's llama4 apply_fsdp does) overlaps more all-gathers; correctness does not need it.
    return sharded


def _sublayers(block: nn.Module, names: Sequence[str]) -> list[nn.Module]:
    """The children of `block` named in `names`, looked up inside an activation-checkpoint wrapper (whose
    recompute then runs their FSDP hooks again: the unit is gathered anew in backward, as a whole block is)."""
    inner = block._checkpoint_wrapped_module if isinstance(block, ActivationWrapper) else block
    return [child for name, child in inner.named_children() if name in names]


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
