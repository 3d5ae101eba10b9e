"""What `torchpre.parallel.parallelize` applies for a job: the family's plans bound to the config's layout options
(`ParallelPlan`), and the FSDP and quantization plans read from their config sections."""

import functools
from collections.abc import Callable

import torch
from torch import nn

from torchpre.config.job_config import JobConfig
from torchpre.models.args import ModelArgs
from torchpre.models.registry import ModelSpec
from torchpre.parallel.api import ParallelPlan
from torchpre.parallel.context_parallel import ContextParallel
from torchpre.parallel.data_parallel import DataParallel, FSDPPlan
from torchpre.parallel.pipeline import PipelinePlan
from torchpre.parallel.quantize import QuantizePlan, resolve_emulate


def quantize_plan(config: JobConfig, device: torch.device, blocks: str) -> QuantizePlan:
    """The quantize section as `torchpre.parallel.quantize.convert_linears` takes it: by default the linears inside
    `blocks` (the family's block container), emulation resolved for `device` (refused there when asked off on a
    device without the kernels)."""
    q = config.quantize
    emulate = q.linear != "none" and resolve_emulate(q.linear, q.emulate, device)
    modules = tuple(q.modules) or (f"{blocks}.*",)
    return QuantizePlan(q.linear, q.recipe, modules, emulate, q.fsdp_float8_all_gather)


def fsdp_plan(
    config: JobConfig, pipeline: PipelinePlan | None, data_parallel: DataParallel, sublayers: tuple[str, ...] = ()
) -> FSDPPlan:
    """How FSDP2 shards the parameters. Resharding after forward defaults to on without a pipeline (the gathered
    parameters of a block are freed until its backward) and off with one: a stage runs one forward per
    microbatch, and keeping its gathered parameters saves an all-gather per block and microbatch, while
    torch's pipeline stage keeps them through the step's backwards in any case. `sublayers` are the family's
    (`ModelBuild.sublayers`), the units of `parallelism.fsdp_wrap = "sublayer"` (`check_keys_take_effect` refuses
    the key for a family that names none)."""
    t, p = config.training, config.parallelism
    reshard = {"always": True, "never": False, "default": pipeline is None}[p.fsdp_reshard_after_forward]
    return FSDPPlan(
        param_dtype=torch.bfloat16 if t.mixed_precision_param == "bfloat16" else None,
        reduce_dtype=data_parallel.reduce_dtype,
        reshard_after_forward=reshard,
        byte_all_gather=config.quantize.fsdp_float8_all_gather,
        sublayers=sublayers if p.fsdp_wrap == "sublayer" else (),
    )


def parallel_plan(
    config: JobConfig,
    spec: ModelSpec,
    args: ModelArgs,
    pipeline: PipelinePlan | None,
    data_parallel: DataParallel | None = None,
    context_parallel: ContextParallel | None = None,
) -> ParallelPlan:
    """What `parallelize` applies for this job: the family's plans and the config's layout options, FSDP when
    `data_parallel` (training's strategy; generation and conversion load any checkpoint unsharded) shards the
    parameters, and the family's context-parallel attention bound to `context_parallel` (training under cp)."""
    p, ac = config.parallelism, config.activation_checkpoint
    tensor_parallel = spec.parallel.tensor_parallel
    if callable(tensor_parallel):
        saving = {"save_sequence_shard": True} if p.sequence_parallel_save_shard else {}
        tensor_parallel = functools.partial(
            tensor_parallel,
            sequence_parallel=p.enable_sequence_parallel,
            loss_parallel=p.enable_loss_parallel,
            **saving,  # only families with `saves_sequence_shard` take it: check_layout refuses the others
        )
    shards_parameters = data_parallel is not None and data_parallel.shards_parameters
    return ParallelPlan(
        tensor_parallel=tensor_parallel,
        expert_parallel=spec.parallel.expert_parallel,
        pipeline=pipeline,
        blocks=spec.blocks_of(args),
        extra_blocks=spec.build.extra_blocks(args),
        tied_weights=spec.build.tied_weights(args),
        activation_checkpoint=ac.mode,
        selective_ac_option=ac.selective_ac_option,
        compile=config.compile.enable,
        compile_fullgraph=spec.parallel.compile_fullgraph,
        fsdp=fsdp_plan(config, pipeline, data_parallel, spec.build.sublayers) if shards_parameters else None,
        context_parallel=None if context_parallel is None else _bind(spec.parallel.context_parallel, context_parallel),
        recompute_mlp_activation=spec.parallel.recompute_mlp_activation if ac.recompute_mlp_activation else None,
    )


def _bind(
    apply: Callable[[nn.Module, ContextParallel], None], context_parallel: ContextParallel
) -> Callable[[nn.Module], None]:
    """`apply(part, context_parallel)` as the one-argument function `ParallelPlan.context_parallel` calls."""
    return lambda part: apply(part, context_parallel)
