"""A layout's predicted per-rank memory and step time, from the dry run's counts (`pieces`) and a `Hardware`.

Memory per pipeline rank = its stage chunks' parameters, gradients and optimizer state (`state_pieces`) + the
activations its schedule holds at once (each chunk's saved bytes for each of its microbatches in flight, walked over
the schedule's action order: `schedule_walk.held_peak`), + the largest transient, + under ZeRO-3 the parameters FSDP
gathers. Step time = `time_model.step_time` over the same chunks'
forward and backward work. `fits` compares the largest rank's allocator peak (what a GPU run reports, the tensors
x 1.18: `torchpre.planner.allocator`) with what the allocator may reserve (`Hardware.allocator_bytes`).
"""

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from torchpre.assembly.meta import meta_model
from torchpre.config.job_config import JobConfig
from torchpre.models.args import ModelArgs
from torchpre.models.registry import get_model_spec
from torchpre.planner.allocator import COMPILED_SAVED_KEPT, reserved_bytes
from torchpre.planner.cost_cache import Measured
from torchpre.planner.dryrun import accumulated_grad_itemsize, gathered_blocks, peak_bytes
from torchpre.planner.hardware import Hardware
from torchpre.planner.layout_space import CheckedLayout
from torchpre.planner.schedule_walk import held_peak
from torchpre.planner.stage_costs import MicrobatchCost, Pieces, StateCost, StepTransient, stage_shape
from torchpre.planner.time_model import RankWork, StepTime, TimeLayout, Work, step_time
from torchpre.step_rules.zero_stages import zero_stage

# The stated error of the predictions (relative), from the comparison with torchtitan's published H100 runs
# (bench/plan_vs_published.py, docs/planning.md): printed next to every prediction.
ERROR_BARS = {"memory_gib": 0.10, "tokens_per_s_per_gpu": 0.20, "mfu": 0.20}
# FSDP2 units per block, each one all-gather and one reduce-scatter: the block; or its norms, attention and
# feed-forward (a MoE block under expert parallelism has its experts as one more unit, left out here).
FSDP_UNITS_PER_BLOCK = {"block": 1, "sublayer": 3}
OPTIMIZER_OPS_PER_TENSOR = 12  # eager ops of single-tensor AdamW per parameter tensor (torch's _single_tensor_adamw)


@dataclass(frozen=True)
class RankPrediction:
    """One pipeline rank's predicted memory, bytes."""

    pp_rank: int
    param_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    activation_bytes: int
    optimizer_step_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        """The tensor peak, as the dry run counts it."""
        return peak_bytes(self)

    @property
    def reserved_bytes(self) -> int:
        """The peak the CUDA caching allocator reserves (`torchpre.planner.allocator`)."""
        return reserved_bytes(self.total_bytes)


@dataclass(frozen=True)
class Prediction:
    checked: CheckedLayout
    ranks: list[RankPrediction]
    step: StepTime | None  # None when the state alone does not fit (not worth timing)
    tokens_per_step: int
    flops_per_token: int
    gpus: int
    hardware: Hardware
    works: tuple[RankWork, ...] = ()  # each pipeline rank's work, as timed (`on` times it on other hardware)
    time_layout: TimeLayout | None = None

    def on(self, hardware: Hardware) -> "Prediction":
        """The same layout on another hardware profile: its pieces and memory stay, its step is timed anew (a fit
        of a profile's efficiencies times every row again without probing it)."""
        step = step_time(self.time_layout, self.works, hardware) if self.works else None
        return dataclasses.replace(self, step=step, hardware=hardware)

    @property
    def peak(self) -> RankPrediction:
        return max(self.ranks, key=lambda r: r.total_bytes)

    @property
    def reserved_bytes(self) -> int:
        """The busiest rank's predicted allocator peak: what a GPU run reports (max_memory_reserved)."""
        return self.peak.reserved_bytes

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_sec / self.gpus

    @property
    def fits(self) -> bool:
        """The busiest rank's allocator peak within what the allocator may reserve: the tensors alone fitting is not
        enough (30 of 140 layouts a search once called fitting predicted more than the card holds)."""
        return self.reserved_bytes <= self.hardware.allocator_bytes

    @property
    def tokens_per_sec(self) -> float:
        return self.tokens_per_step / self.step.total_s if self.step else 0.0

    @property
    def mfu_peak(self) -> str:
        """Which peak MFU divides by: the GPU's FP8 one when quantize.linear puts the linears in FP8 and it has one."""
        fp8 = self.checked.config.quantize.linear != "none" and self.hardware.fp8_peak_flops > 0
        return "fp8" if fp8 else "bf16"

    @property
    def mfu(self) -> float:
        peak = self.hardware.fp8_peak_flops if self.mfu_peak == "fp8" else self.hardware.peak_flops
        return self.flops_per_token * self.tokens_per_sec / (self.gpus * peak)

    def as_dict(self) -> dict[str, Any]:
        peak = self.peak
        return {
            **self.checked.layout.as_dict(),
            "memory_bytes": peak.total_bytes,
            "param_bytes": peak.param_bytes,
            "grad_bytes": peak.grad_bytes,
            "optimizer_state_bytes": peak.optimizer_state_bytes,
            "activation_bytes": peak.activation_bytes,
            "optimizer_step_bytes": peak.optimizer_step_bytes,
            "step_time_s": self.step.total_s if self.step else None,
            "tokens_per_sec": self.tokens_per_sec,
            "memory_gib": self.reserved_bytes / 2**30,
            "tensor_memory_gib": self.peak.total_bytes / 2**30,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "mfu": self.mfu,
            "mfu_peak": self.mfu_peak,
            "error_bars": ERROR_BARS,
            "fits": self.fits,
            "breakdown": {
                "step": self.step.as_dict() if self.step else None,
                "ranks": [dataclasses.asdict(r) | {"total_bytes": r.total_bytes} for r in self.ranks],
            },
        }


def predict(
    checked: CheckedLayout, hardware: Hardware, gpus: int, flops_per_token: int, measured: Measured | None = None
) -> Prediction:
    """The layout's per-rank memory and, if its model state fits, its step time; its pieces from `measured` (a
    search's, shared by its layouts) or measured for it alone."""
    config, layout = checked.config, checked.layout
    measured = Measured() if measured is None else measured
    states, step = measured.state(checked), measured.step(checked)
    chunks = [tuple(stage_shape(checked, pp_rank)) for pp_rank in range(layout.pp)]
    # A deep pipeline's ranks hold a few distinct shapes of chunks (most hold the same blocks): each shape is costed
    # once, the same numbers for every rank that holds it.
    shapes = dict.fromkeys(chunks)
    state_of = {shape: _rank_state(states, step, shape) for shape in shapes}
    rank_states = [state_of[shape] for shape in chunks]
    state = max(s.param_bytes + s.grad_bytes + s.optimizer_state_bytes for s in rank_states)
    if reserved_bytes(state) > hardware.allocator_bytes:
        ranks = [RankPrediction(r, s.param_bytes, s.grad_bytes, s.optimizer_state_bytes, 0, s.optimizer_step_bytes)
                 for r, s in enumerate(rank_states)]  # fmt: skip
        return Prediction(checked, ranks, None, 0, flops_per_token, gpus, hardware)  # not worth probing
    work_pieces = measured.microbatch(checked)
    costs_of = {shape: [work_pieces.stage(*chunk, zero=MicrobatchCost()) for chunk in shape] for shape in shapes}
    work_of = {shape: _rank_work(checked, costs_of[shape], state_of[shape]) for shape in shapes}
    ranks = []
    for pp_rank, (shape, state) in enumerate(zip(chunks, rank_states)):
        activations = _activation_bytes(checked, pp_rank, costs_of[shape], states, list(shape), work_pieces.block)
        grads = _step_grad_bytes(checked, states, list(shape), state)
        ranks.append(RankPrediction(pp_rank, state.param_bytes, grads, state.optimizer_state_bytes, activations,
                                    state.optimizer_step_bytes))  # fmt: skip
    works, time_layout = tuple(work_of[shape] for shape in chunks), _time_layout(checked)
    timing = step_time(time_layout, works, hardware)
    tokens = config.training.global_batch_size * config.training.seq_len
    return Prediction(checked, ranks, timing, tokens, flops_per_token, gpus, hardware, works, time_layout)


def _rank_state(states: Pieces, step: StepTransient, shape: tuple) -> StateCost:
    """What a rank holding the stage chunks `shape` ((blocks, first, last) each) keeps, its optimizer step's
    transient included."""
    return dataclasses.replace(
        sum((states.stage(*c, zero=StateCost()) for c in shape), StateCost()),
        optimizer_step_bytes=step.at(sum(blocks for blocks, _, _ in shape)),
    )


def model_flops_per_token(config: JobConfig, args: ModelArgs) -> int:
    """The trainer's FLOPs per token (what its MFU divides by), from the whole model's parameter count."""
    spec = get_model_spec(config.model.name)
    num_params = sum(p.numel() for p in meta_model(config, spec, args).parameters())
    return spec.build.flops_per_token(args, num_params, config.training.seq_len)


def _activation_bytes(
    checked: CheckedLayout, pp_rank: int, costs: list[MicrobatchCost], states: Pieces, chunks: list,
    block: MicrobatchCost,
) -> int:
    """What `torchpre.planner.dryrun.probe_rank` adds up for a built rank, from the pieces."""
    layout, pipeline = checked.layout, checked.pipeline
    held = pipeline is not None
    cut = [_compiled_cut(checked, block, blocks) for blocks, _, _ in chunks]
    chunk_bytes = [c.saved_bytes - k + (c.pipeline_held_bytes if held else 0) for c, k in zip(costs, cut)]
    if pipeline is None:
        saved = chunk_bytes[0]
    else:
        saved = held_peak(pipeline.schedule.name, pipeline.pp, pipeline.n_microbatches, pp_rank, chunk_bytes)
    transient = max(c.transient_bytes for c in costs)
    gathered = 0
    if zero_stage(layout.zero_stage).shards_parameters:
        itemsize = getattr(torch, checked.config.training.mixed_precision_param).itemsize
        if _reshards_after_forward(checked.config):
            gathered = gathered_blocks(checked.config) * states.block.tp_numel * itemsize
        else:
            gathered = sum(states.stage(*chunk, zero=StateCost()).tp_numel for chunk in chunks) * itemsize
    return int(saved + transient + gathered)


def _step_grad_bytes(checked: CheckedLayout, states: Pieces, chunks: list, state: StateCost) -> int:
    """The rank's gradients during the step, as `torchpre.planner.dryrun.probe_rank` counts them: ZeRO-3 under
    pipelining keeps them unsharded until the last microbatch (`accumulated_grad_itemsize`), other layouts their
    sharded or replicated gradients."""
    if checked.pipeline is None or not zero_stage(checked.layout.zero_stage).shards_parameters:
        return state.grad_bytes
    numel = sum(states.stage(*chunk, zero=StateCost()).tp_numel for chunk in chunks)
    return numel * accumulated_grad_itemsize(checked.config)


def _compiled_cut(checked: CheckedLayout, block: MicrobatchCost, blocks: int) -> float:
    """The saved bytes compile spares a stage chunk of `blocks` blocks: (1 - COMPILED_SAVED_KEPT[AC mode]) of what
    its eager blocks save beyond their inputs (`torchpre.planner.allocator`); none without compile or under full
    AC, where blocks save their inputs only (what compile spares there is in the recomputation, a transient: the
    pieces' `torchpre.planner.stage_costs._recompute_kept`)."""
    config = checked.config
    mode = config.activation_checkpoint.mode
    if not config.compile.enable or mode == "full":
        return 0.0
    beyond_input = max(block.saved_bytes - _block_input_bytes(checked), 0)
    return (1 - COMPILED_SAVED_KEPT[mode]) * blocks * beyond_input


def _block_input_bytes(checked: CheckedLayout) -> int:
    """One microbatch's hidden states entering a block on one rank (its share under cp and sequence parallelism)."""
    config = checked.config
    itemsize = getattr(torch, config.training.mixed_precision_param).itemsize
    return checked.layout.microbatch_size * _local_seq(config) * checked.model_args.dim * itemsize


def _local_seq(config: JobConfig) -> int:
    """A rank's positions of each sequence: its 1 / cp share, and 1 / tp of that under sequence parallelism."""
    p = config.parallelism
    seq = config.training.seq_len // p.context_parallel_degree
    return seq // p.tensor_parallel_degree if p.enable_sequence_parallel and p.tensor_parallel_degree > 1 else seq


def _reshards_after_forward(config: JobConfig) -> bool:
    """`parallelism.fsdp_reshard_after_forward` as the build resolves it (default: not under pipelining)."""
    choice = config.parallelism.fsdp_reshard_after_forward
    if choice == "default":
        return config.parallelism.pipeline_parallel_degree == 1
    return choice == "always"


def _rank_work(checked: CheckedLayout, costs: list[MicrobatchCost], state: StateCost) -> RankWork:
    config = checked.config
    t, p = config.training, config.parallelism
    microbatch = p.pipeline_parallel_microbatch_size if p.pipeline_parallel_degree > 1 else t.local_batch_size
    seq = _local_seq(config)
    compute = getattr(torch, t.mixed_precision_param).itemsize
    args_dim = checked.model_args.dim  # the job's width: model.dim may set it on top of the flavor
    reduce = getattr(torch, config.optimizer.reduce_dtype).itemsize
    dense = state.tp_numel - state.expert_numel  # experts are reduced and gathered over edp, the rest over dp
    forward = sum((c.forward for c in costs), Work(0.0))
    backward = sum((c.backward for c in costs), Work(0.0))
    return RankWork(
        forward=forward,
        backward=backward,
        boundary_bytes=microbatch * seq * args_dim * compute,
        grad_bytes=dense * reduce,
        param_bytes=dense * compute,
        expert_grad_bytes=state.expert_numel * reduce,
        expert_param_bytes=state.expert_numel * compute,
        optimizer_state_bytes=state.optimizer_state_bytes,
        optimizer_ops=OPTIMIZER_OPS_PER_TENSOR * state.param_tensors,
    )


def _time_layout(checked: CheckedLayout) -> TimeLayout:
    layout, pipeline = checked.layout, checked.pipeline
    return TimeLayout(
        dp=layout.dp,
        tp=layout.tp,
        pp=layout.pp,
        ep=layout.ep,
        cp=layout.cp,
        microbatches=checked.microbatches,
        schedule=pipeline.schedule.name if pipeline else "1F1B",
        stages_per_rank=pipeline.stages_per_rank if pipeline else 1,
        zero_stage=layout.zero_stage,
        bucket_bytes=checked.config.optimizer.bucket_size_mb * 2**20,
        compiled=checked.config.compile.enable,
        reshard_after_forward=_reshards_after_forward(checked.config),
        fsdp_units_per_block=FSDP_UNITS_PER_BLOCK[checked.config.parallelism.fsdp_wrap],
    )
