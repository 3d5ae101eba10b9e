"""A layout's per-rank costs from the dry run's own code, made fast by linearity.

Building every rank of every candidate layout of a 405B job would take hours. But a block's parameters,
gradients, optimizer state, saved activations and FLOPs do not depend on which stage holds it or how many
blocks sit beside it: a stage costs `ends + blocks x block`. So the planner dry-runs the layout's tensor, data
and expert sharding on shortened copies of the model (`shortened_flavor`), pipelined over two stages: a + 1 blocks
(stage 0: embedding + a blocks; stage 1: 1 block + norm and head) and a + 2 blocks (stage 0: embedding + a + 1
blocks), where a is 1, or a MoE family's dense first blocks (`leading_blocks`: DeepSeek-V3's 3). Then block = the
difference of the two stage 0s (a block of the kind that repeats), the first stage's ends are the shorter stage 0
whole (with its a leading blocks), and the last stage's are its stage 1 less a block. Every number is what
`torchpre.planner.dryrun.rank_memory` reports for a real build: no separate formula that could drift from it
(`tests/unit/test_plan.py::test_planner_memory_is_the_dry_runs` and `::test_moe_planner_memory_is_the_dry_runs` pin
the sum to full dry runs).
"""

import contextlib
import copy
import dataclasses
import itertools
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from torchpre.assembly.parametrization import with_model_shape
from torchpre.config.job_config import JobConfig, Quantize
from torchpre.config.parser import to_toml
from torchpre.models.registry import get_model_spec
from torchpre.models.shapes import SHAPE_KEYS
from torchpre.planner.activation_probe import ActivationProbe, ProbedCollective
from torchpre.planner.allocator import COMPILED_SAVED_KEPT
from torchpre.planner.dryrun import (
    is_expert,
    leave_fake_world,
    optimizer_step_bytes,
    probe_rank_parts,
    rank_memory,
    unsharded_numel,
)
from torchpre.planner.layout_space import CheckedLayout
from torchpre.planner.time_model import Collective, Work
from torchpre.runtime.world import Runtime
from torchpre.step_rules.zero_stages import zero_stage
from torchpre.training.job import build_job

T = TypeVar("T")


@dataclass(frozen=True)
class StateCost:
    """Bytes one rank keeps through training for a piece of the model (a block, or a stage's ends), and the
    piece's parameter count on this rank before any data-parallel sharding (what DP communication moves), of which
    `expert_numel` are expert-parallel experts' (reduced over edp instead of dp)."""

    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_state_bytes: int = 0
    tp_numel: int = 0
    param_tensors: int = 0
    # The optimizer step's transient (`torchpre.planner.dryrun.optimizer_step_bytes`), measured on stage 0 only
    # (`StepTransient`: 0 on the last stage's build, whose step would cost a third of the builds' time).
    optimizer_step_bytes: int = 0
    expert_numel: int = 0

    def __add__(self, other: "StateCost") -> "StateCost":
        return StateCost(*(a + b for a, b in zip(self.numbers(), other.numbers())))

    def __sub__(self, other: "StateCost") -> "StateCost":
        return StateCost(*(a - b for a, b in zip(self.numbers(), other.numbers())))

    def scaled(self, k: int) -> "StateCost":
        """k identical blocks."""
        return StateCost(*(a * k for a in self.numbers()))

    def interpolated(self, other: "StateCost", k: float) -> "StateCost":
        """self + k x (other - self), to the byte (`affine`)."""
        return StateCost(*(round(a + k * (b - a)) for a, b in zip(self.numbers(), other.numbers())))

    def numbers(self) -> tuple[int, ...]:
        """The fields in order (`dataclasses.astuple` without its deep copies: a search adds millions of these)."""
        return tuple(getattr(self, name) for name in _STATE_FIELDS)


_STATE_FIELDS = tuple(f.name for f in dataclasses.fields(StateCost))


@dataclass(frozen=True)
class MicrobatchCost:
    """One microbatch through a piece on one rank: the activations it saves for backward and its largest
    transient, and the work of its forward and of its backward (recomputation included), as `Work`."""

    saved_bytes: float = 0.0
    transient_bytes: float = 0.0
    forward: Work = Work(0.0)
    backward: Work = Work(0.0)
    # What a pipeline stage keeps per microbatch in flight (`torchpre.planner.dryrun.PartProbe`): its received input
    # and, on the last stage, its output. Only the ends' are measured (`Pieces.stage` places them).
    received_bytes: float = 0.0
    held_output_bytes: float = 0.0
    # The probe's live bytes beyond the saved ones after each allocation (`ActivationProbe.transient_trace`): what
    # `interpolated` extends to another size. Only probed pieces carry it; sums and multiples of them do not.
    transient_trace: tuple[float, ...] = ()

    @property
    def pipeline_held_bytes(self) -> float:
        return self.received_bytes + self.held_output_bytes

    def __add__(self, other: "MicrobatchCost") -> "MicrobatchCost":
        return MicrobatchCost(
            self.saved_bytes + other.saved_bytes,
            max(self.transient_bytes, other.transient_bytes),
            self.forward + other.forward,
            self.backward + other.backward,
            max(self.received_bytes, other.received_bytes),
            self.held_output_bytes + other.held_output_bytes,
        )

    def minus(self, other: "MicrobatchCost") -> "MicrobatchCost":
        """The difference of two probes of the same stage with more and fewer blocks (one block's cost), or the last
        stage less its block (its ends); the transient stays the larger probe's (see `_microbatch_pieces`)."""
        return MicrobatchCost(
            self.saved_bytes - other.saved_bytes,
            self.transient_bytes,
            _work_minus(self.forward, other.forward),
            _work_minus(self.backward, other.backward),
            self.received_bytes,
            self.held_output_bytes - other.held_output_bytes,
            self.transient_trace,
        )

    def interpolated(self, other: "MicrobatchCost", k: float) -> "MicrobatchCost":
        """self + k x (other - self), number by number (`affine`); the op counts are self's. The transient is the
        maximum of the transient traces interpolated entry by entry (every live total is a sum of tensor sizes,
        affine where they are; the moment of the peak may move), or, where the two probes allocated a different
        number of times, the transients interpolated."""

        def grow(a: float, b: float) -> float:
            return a + k * (b - a)

        def work(a: Work, b: Work) -> Work:
            pairs = zip(a.collectives, b.collectives)
            collectives = tuple(Collective(x.op, x.dim, grow(x.bytes, y.bytes), x.count) for x, y in pairs)
            return Work(grow(a.flops, b.flops), grow(a.other_bytes, b.other_bytes), a.ops, collectives, a.subclass_ops,
                        grow(a.fp8_flops, b.fp8_flops), grow(a.attention_flops, b.attention_flops),
                        grow(a.fp8_cast_elements, b.fp8_cast_elements))

        trace: tuple[float, ...] = ()
        transient = grow(self.transient_bytes, other.transient_bytes)
        if self.transient_trace and len(self.transient_trace) == len(other.transient_trace):
            trace = tuple(grow(a, b) for a, b in zip(self.transient_trace, other.transient_trace))
            transient = max((0.0, *trace))
        return MicrobatchCost(
            grow(self.saved_bytes, other.saved_bytes),
            transient,
            work(self.forward, other.forward),
            work(self.backward, other.backward),
            grow(self.received_bytes, other.received_bytes),
            grow(self.held_output_bytes, other.held_output_bytes),
            trace,
        )

    def scaled(self, k: int) -> "MicrobatchCost":
        """k identical blocks in a row: k times the saved bytes and work, one block's transient at a time."""
        return MicrobatchCost(
            self.saved_bytes * k,
            self.transient_bytes,
            _times(self.forward, k),
            _times(self.backward, k),
        )


def _times(work: Work, k: int) -> Work:
    """k times `work`: each collective's count k times (one entry each, not k: the time model sums them)."""
    collectives = tuple(dataclasses.replace(c, count=c.count * k) for c in work.collectives)
    return Work(work.flops * k, work.other_bytes * k, work.ops * k, collectives, work.subclass_ops * k,
                work.fp8_flops * k, work.attention_flops * k, work.fp8_cast_elements * k)


@dataclass(frozen=True)
class Pieces(Generic[T]):
    """A layout's costs per piece: one block; the first stage's ends together with its first `leading` blocks (a
    MoE family's dense first blocks, else one block: measured whole, as a dense block's collectives are not a MoE
    block's less some); and the ends only the last stage holds."""

    block: T
    first: T
    last: T
    leading: int = 1

    def stage(self, blocks: int, first: bool, last: bool, zero: T) -> T:
        """A stage of `blocks` blocks, with the first stage's and/or the last stage's ends. A microbatch cost's
        transient is the one measured on a stage of the same kind: the last stage's (the loss; also a whole
        model's, measured equal), else the first's, else a middle stage's. A first stage of fewer than `leading`
        blocks (the embedding alone, parallelism.pipeline_parallel_embedding_layers) is its ends less the blocks it
        lacks: exact for a dense model (`tests/unit/test_plan.py`); its transient stays the measured first stage's,
        which holds a block."""
        repeated = self.block.scaled(blocks - self.leading if first else blocks)
        total = repeated + (self.first if first else zero) + (self.last if last else zero)
        if not isinstance(self.block, MicrobatchCost):
            return total
        kind = self.last if last else self.first if first else self.block
        received = 0.0 if first else self.last.received_bytes  # every later stage receives the same residual stream
        return dataclasses.replace(total, transient_bytes=kind.transient_bytes, received_bytes=received)


@contextlib.contextmanager
def shortened_flavor(config: JobConfig, stage_blocks: Sequence[int]) -> Iterator[JobConfig]:
    """`config` with its model flavor cut to sum(`stage_blocks`) blocks (registered under a temporary flavor name),
    pipeline stage i holding stage_blocks[i] of them. The job's shape keys (model.dim, n_layers, ...) are applied
    to the flavor first and cleared, so the cut model has the job's width and the probes' depth."""
    spec = get_model_spec(config.model.name)
    args = with_model_shape(config.model, spec.flavors[config.model.flavor])
    n_layers = sum(stage_blocks)
    # The name carries the shape keys it folds in: the probes' caches know a config by its TOML, flavor name and all.
    shape = "".join(f"{key} {getattr(config.model, key)}, " for key in SHAPE_KEYS if getattr(config.model, key))
    name = f"{config.model.flavor}[{shape}{n_layers} layers]"
    spec.flavors[name] = dataclasses.replace(args, n_layers=n_layers)
    short = copy.deepcopy(config)
    short.model.flavor = name
    for key in SHAPE_KEYS:  # folded into the flavor: model.n_layers would otherwise restore the full depth
        setattr(short.model, key, 0)
    starts = itertools.accumulate(stage_blocks[:-1])
    short.parallelism.pipeline_parallel_split_points = [f"{spec.build.blocks}.{start}" for start in starts]
    # The split points place every block: the job's even-split counts (the embedding or output as layers) are the
    # stage shapes' to apply (`stage_shape`), not the probes'.
    short.parallelism.pipeline_parallel_embedding_layers = short.parallelism.pipeline_parallel_output_layers = 0
    try:
        yield short
    finally:
        del spec.flavors[name]


def leading_blocks(config: JobConfig) -> int:
    """Blocks the probes' first stage holds: the model's dense first blocks (the MoE families' `first_k_dense`),
    and at least one. Every block after them is of one kind, so the block piece is that kind and the first stage's
    ends include the dense blocks (which a first stage must hold: `torchpre.planner.layout_space.check`)."""
    args = get_model_spec(config.model.name).flavors[config.model.flavor]
    return max(args.first_k_dense, 1)


def two_stage_config(config: JobConfig, microbatch_size: int = 1) -> JobConfig:
    """`config`'s sharding (dp, tp, ep, ZeRO stage, precision, AC), pipelined over two 1F1B stages with the
    fewest microbatches of `microbatch_size` that allows."""
    config = copy.deepcopy(config)
    p, t = config.parallelism, config.training
    p.pipeline_parallel_degree, p.pipeline_parallel_schedule = 2, "1F1B"
    p.pipeline_parallel_virtual_stages, p.pipeline_parallel_split_points = 1, []
    p.pipeline_parallel_microbatch_size = microbatch_size
    t.local_batch_size = 2 * microbatch_size
    t.global_batch_size = t.local_batch_size * p.data_parallel_degree
    return config


def _pieces(measure: Callable[[JobConfig, int, int], T], config: JobConfig, subtract: Callable[[T, T], T]) -> Pieces:
    """Pieces from three builds of `config` shortened and split over two stages (see the module docstring):
    `measure(config, world, rank)`. The first stage holds a = `leading_blocks` blocks, then a + 1."""
    world, a = 2 * _model_ranks(config), leading_blocks(config)
    with shortened_flavor(config, (a, 1)) as short:
        first_a, last_a = measure(short, world, 0), measure(short, world, world // 2)
    with shortened_flavor(config, (a + 1, 1)) as longer:
        first_longer = measure(longer, world, 0)
    block = subtract(first_longer, first_a)
    return Pieces(block=block, first=first_a, last=subtract(last_a, block), leading=a)


def state_pieces(config: JobConfig) -> Pieces:
    """`StateCost` pieces of a layout's config: builds only, no probes; cached by the probed config (with
    activation checkpointing off: it changes no state; cp folded into dp: see `state_config`). The optimizer
    step's transient is not additive (see `StepTransient`): the pieces carry 0 for it."""
    return _in_one_over("ep", state_config(config), _measured_state_pieces, affine)


def _measured_state_pieces(config: JobConfig) -> Pieces:
    return _cached("state\n" + to_toml(config), lambda: _pieces(_state, config, lambda a, b: a - b))


@dataclass(frozen=True)
class StepTransient:
    """The optimizer step's transient bytes on a stage of n blocks. It grows with the parameters while they fit
    in one gradient bucket (ZeRO 0-2 flatten a bucket to reduce and gather it) and then stays at what the largest
    bucket or parameter needs: measured on stage 0 with `blocks` (= `leading_blocks`) and one more block (the
    growth per block) and, when it grows, with enough blocks to fill a bucket (the ceiling)."""

    blocks: int
    bytes: int
    per_block: int
    ceiling: int

    def at(self, blocks: int) -> int:
        return min(self.bytes + max(blocks - self.blocks, 0) * self.per_block, self.ceiling)

    def interpolated(self, other: "StepTransient", k: float) -> "StepTransient":
        """self + k x (other - self), byte by byte (an estimate: the step's buckets need not be affine in it)."""
        grow = [round(a + k * (b - a)) for a, b in zip(dataclasses.astuple(self)[1:], dataclasses.astuple(other)[1:])]
        return StepTransient(self.blocks, *grow)


def step_transient(config: JobConfig, n_layers: int) -> StepTransient:
    """The optimizer step's transient, measured (interpolated in 1 / ep between two measured degrees, as the
    state pieces, under expert parallelism)."""

    def measure(config: JobConfig) -> StepTransient:
        key = "step\n" + to_toml(config)
        if key not in _STEP_CACHE:
            _STEP_CACHE[key] = _measure_step_transient(config, n_layers)
        return _STEP_CACHE[key]

    return _in_one_over("ep", state_config(config), measure, lambda one, two, k: one.interpolated(two, k))


def _measure_step_transient(config: JobConfig, n_layers: int) -> StepTransient:
    world, a = 2 * _model_ranks(config), leading_blocks(config)

    def stage_zero(blocks: int) -> StateCost:
        with shortened_flavor(config, (blocks, 1)) as short:
            return _state(short, world, 0)

    one, two = stage_zero(a), stage_zero(a + 1)  # the state pieces' builds (`_state` keeps them)
    per_block = two.optimizer_step_bytes - one.optimizer_step_bytes
    if per_block <= 0:
        return StepTransient(a, one.optimizer_step_bytes, 0, one.optimizer_step_bytes)
    block_grads = max(two.grad_bytes - one.grad_bytes, 1)
    filled = min(n_layers, -(-int(config.optimizer.bucket_size_mb * 2**20) // block_grads) + a)
    ceiling = stage_zero(filled).optimizer_step_bytes if filled > a + 1 else two.optimizer_step_bytes
    return StepTransient(a, one.optimizer_step_bytes, per_block, ceiling)


def state_config(config: JobConfig) -> JobConfig:
    """The config whose builds give a layout's state: two stages, no activation checkpointing, and context
    parallelism folded into data parallelism (dp x cp ranks at cp 1). Parameters, gradients and optimizer state
    do not depend on how a sequence is split, and every mesh view's dp dimension already spans dp x cp ranks
    (`torchpre.distributed.parallel_dims.Meshes`): ZeRO and FSDP shard over them, DP reduces over them. So the cp
    layouts of a search reuse the builds of the layouts without cp (to the byte: `tests/unit/test_plan.py`). Under
    ZeRO-0 nothing is sharded over dp: every dp > 1 holds what dp2 holds (dp1 keeps its gradients in place of
    buckets), so dense layouts are built at dp2 at most."""
    config = copy.deepcopy(config)
    p = config.parallelism
    p.data_parallel_degree, p.context_parallel_degree = p.data_parallel_degree * p.context_parallel_degree, 1
    if not zero_stage(config.optimizer.zero_stage).shards_optimizer_state and p.expert_parallel_degree == 1:
        p.data_parallel_degree = min(p.data_parallel_degree, 2)
    config = two_stage_config(config)
    config.activation_checkpoint.mode = "none"
    return config


def microbatch_pieces(config: JobConfig, microbatch_size: int) -> Pieces:
    """`MicrobatchCost` pieces of a layout's config at `microbatch_size`. Probed at data-parallel degree 1 (the
    expert-parallel degree under EP) and ZeRO-1: activations and work per microbatch do not depend on how the
    state is sharded over DP (ZeRO-3's gathered parameters are the caller's to add). Under expert parallelism a
    rank's routed rows (a balanced router's) and all-to-all buffers do not depend on ep either, and what does is
    interpolated in 1 / ep; under context parallelism, in 1 / cp (`_in_one_over`)."""

    def in_one_over_ep(config: JobConfig) -> Pieces:
        return _in_one_over("ep", config, lambda config: _probed_microbatch_pieces(config, microbatch_size), affine)

    return _in_one_over("cp", config, in_one_over_ep, affine)


_DEGREES = {"ep": "expert_parallel_degree", "cp": "context_parallel_degree"}


def _in_one_over(
    dim: str, config: JobConfig, measure: Callable[[JobConfig], T], interpolate: Callable[[T, T, float], T]
) -> T:
    """`measure(config)`; for a degree n of `dim` ("ep" or "cp") with two divisors above 1 below it, measured at
    those two smallest ones and interpolated in 1 / n between them (`interpolate(at_low, at_high, k)`), when they
    ran the same ops. Under expert parallelism what a rank holds and does depends on ep through its local experts
    only (1 / ep of them) and the bookkeeping of its dispatch; under context parallelism through its 1 / cp share
    of each sequence (activations, work, and causal attention's scores: the head-tail split gives a rank two
    chunks whose scores add up to seq x (seq + 1) / 2cp) and the keys and values it gathers (whole sequences:
    constant). Every tensor is affine in 1 / n, and so is every count and live total (to the byte: deepseek_v3
    lite measured at ep 2, 4, 8 and 16; `tests/unit/test_plan.py` at ep 8 and cp 8). So a search measures two
    degrees of each sharding, not every one."""
    n = getattr(config.parallelism, _DEGREES[dim])
    degrees = [d for d in range(2, n) if n % d == 0][:2]
    if len(degrees) < 2:
        return measure(config)
    (low, high), (one, two) = degrees, [measure(_with_degree(config, dim, d)) for d in degrees]
    if not _same_ops(one, two):
        return measure(config)
    return interpolate(one, two, (1 / n - 1 / low) / (1 / high - 1 / low))


def _with_degree(config: JobConfig, dim: str, degree: int) -> JobConfig:
    config = copy.deepcopy(config)
    setattr(config.parallelism, _DEGREES[dim], degree)
    return config


def _same_ops(one: object, two: object) -> bool:
    """Whether two microbatch probes ran the same ops and collectives (their sizes aside): then they
    interpolate. Other measurements (state, the optimizer step) always do."""
    if not isinstance(one, Pieces) or not isinstance(one.block, MicrobatchCost):
        return True

    def shape(work: Work) -> tuple:
        return work.ops, work.subclass_ops, tuple((c.op, c.dim) for c in work.collectives)

    costs = ((one.block, two.block), (one.first, two.first), (one.last, two.last))
    return all(shape(a.forward) == shape(b.forward) and shape(a.backward) == shape(b.backward)
               and len(a.transient_trace) == len(b.transient_trace) for a, b in costs)  # fmt: skip


def _probed_microbatch_pieces(config: JobConfig, microbatch_size: int) -> Pieces:
    config = microbatch_config(config, microbatch_size)
    return _cached("microbatch\n" + to_toml(config), lambda: _microbatch_pieces(config))


def microbatch_config(config: JobConfig, microbatch_size: int) -> JobConfig:
    """The config whose probes give a layout's microbatch costs: its tensor, context and expert sharding over two
    stages, at data-parallel degree ep (1 without experts) and ZeRO-1."""
    config = copy.deepcopy(config)
    config.parallelism.data_parallel_degree = config.parallelism.expert_parallel_degree
    config.optimizer.zero_stage = 1
    return two_stage_config(config, microbatch_size)


def affine(one: Pieces, two: Pieces, k: float) -> Pieces:
    """`one` + k x (`two` - `one`), piece by piece and number by number: costs probed at two values of something
    they are affine in (the microbatch size, 1 / ep), extended to another. The op counts are `one`'s."""
    return Pieces(one.block.interpolated(two.block, k), one.first.interpolated(two.first, k),
                  one.last.interpolated(two.last, k), one.leading)  # fmt: skip


def _microbatch_pieces(config: JobConfig) -> Pieces:
    """Saved bytes and work are linear in the blocks; the transient peak is not (a stage's is set by its
    largest temporaries, e.g. the loss's logits on the last stage), so each piece gets the transient measured
    on a stage of its own kind: the first's and the last's from the 2-stage builds, a block's from the middle
    stage of a 3-stage build (one block on each later stage)."""
    pieces = _pieces(_microbatch, config, lambda a, b: a.minus(b))
    three = copy.deepcopy(config)
    three.parallelism.pipeline_parallel_degree = 3
    three.training.local_batch_size = 3 * config.parallelism.pipeline_parallel_microbatch_size
    three.training.global_batch_size = three.training.local_batch_size * config.parallelism.data_parallel_degree
    world = 3 * _model_ranks(config)
    with shortened_flavor(three, (leading_blocks(config), 1, 1)) as short:
        middle = _microbatch(short, world, world // 3)
    block = dataclasses.replace(pieces.block, transient_bytes=middle.transient_bytes,
                                transient_trace=middle.transient_trace)  # fmt: skip
    return dataclasses.replace(pieces, block=block)


def _model_ranks(config: JobConfig) -> int:
    """The ranks of one pipeline stage: dp x cp x tp."""
    p = config.parallelism
    return p.data_parallel_degree * p.context_parallel_degree * p.tensor_parallel_degree


_CACHE: dict[str, Pieces] = {}  # by kind and probed config: one planner run probes each configuration once
_STEP_CACHE: dict[str, StepTransient] = {}
_STATE_BUILDS: dict[tuple[str, int, int], StateCost] = {}


def _cached(key: str, build: Callable[[], Pieces]) -> Pieces:
    if key not in _CACHE:
        _CACHE[key] = build()
    return _CACHE[key]


def _state(config: JobConfig, world: int, rank: int) -> StateCost:
    """`_measure_state`, once per shortened config and rank: the state pieces and the optimizer step's transient
    build the same stage-0 models."""
    key = (to_toml(config), world, rank)
    if key not in _STATE_BUILDS:
        _STATE_BUILDS[key] = _measure_state(config, world, rank)
    return _STATE_BUILDS[key]


def _measure_state(config: JobConfig, world: int, rank: int) -> StateCost:
    job = build_job(config, Runtime(world, fake_rank=rank, data=False))
    try:
        memory = rank_memory(job, checkpoint=False)
        params = [param for part in job.model.parts for param in part.parameters()]
        numel = [(unsharded_numel(param, job), is_expert(param)) for param in params]
        step = optimizer_step_bytes(job) if rank == 0 else 0
    finally:
        leave_fake_world()
    return StateCost(
        param_bytes=memory.param_bytes,
        grad_bytes=memory.grad_bytes,
        optimizer_state_bytes=memory.optimizer_state_bytes,
        tp_numel=sum(n for n, _ in numel),
        param_tensors=len(params),
        optimizer_step_bytes=step,
        expert_numel=sum(n for n, expert in numel if expert),
    )


def _microbatch(config: JobConfig, world: int, rank: int) -> MicrobatchCost:
    """The rank's microbatch probed eager: the probe counts eager ops on meta tensors, which torch.compile cannot
    trace under its dispatch modes, so the time and memory models account for compile
    (`torchpre.planner.time_model.COMPILE_ELEMENTWISE`, `torchpre.planner.allocator`). Under full activation
    checkpointing a compiled block's recomputation keeps what the compiled block keeps, `COMPILED_SAVED_KEPT["none"]`
    of the eager recomputation's tensors (`_recompute_kept`), which the transient holds at a block's backward. A
    compiled job with FP8 linears takes its memory and elementwise work from the same job in high precision
    (torch.compile fuses torchao's casts, whose eager temporaries and traffic the float8 probe counts: torchtitan's
    compiled Llama 3.1 8B reserves the same with and without Float8, 77.0 and 76.8 GiB), and its matmuls and FP8
    operands from the float8 probe."""
    eager = copy.deepcopy(config)
    eager.compile.enable = False
    kept = _recompute_kept(config)
    cost = _probed_microbatch(eager, world, rank, kept)
    if not config.compile.enable or config.quantize.linear == "none":
        return cost
    eager.quantize = Quantize()
    plain = _probed_microbatch(eager, world, rank, kept)
    return dataclasses.replace(plain, forward=_fused_fp8(cost.forward, plain.forward),
                               backward=_fused_fp8(cost.backward, plain.backward))


def _fused_fp8(fp8: Work, plain: Work) -> Work:
    """`plain`'s elementwise work and collectives with `fp8`'s matmul and attention FLOPs and FP8 operands."""
    return dataclasses.replace(plain, flops=fp8.flops, fp8_flops=fp8.fp8_flops, attention_flops=fp8.attention_flops,
                               fp8_cast_elements=fp8.fp8_cast_elements)


def _recompute_kept(config: JobConfig) -> float:
    """The share of the eager recomputation's tensors a block's recomputation keeps: a compiled block under full
    checkpointing recomputes as its compiled forward, keeping what that keeps (`COMPILED_SAVED_KEPT["none"]`; a
    compiled checkpointed block recomputes inside its compiled backward, a block compiled per child reruns its
    compiled children); otherwise all of it. Per-op checkpointing's recomputation is within its calibrated share."""
    if config.compile.enable and config.activation_checkpoint.mode == "full":
        return COMPILED_SAVED_KEPT["none"]
    return 1.0


def _probed_microbatch(config: JobConfig, world: int, rank: int, recompute_kept: float = 1.0) -> MicrobatchCost:
    """The probe's counts as a `MicrobatchCost`, its transient with `recompute_kept` of the recomputation's
    tensors (moment by moment: the peak may move)."""
    parts = probe_rank_parts(config, world, rank)
    (part,) = parts
    tp, cp = config.parallelism.tensor_parallel_degree, config.parallelism.context_parallel_degree
    forward = to_work(part.forward, tp, cp)
    probe = part.total
    spared = 1 - recompute_kept
    pairs = zip(probe.transient_trace, probe.recomputed_trace, strict=True)
    trace = tuple(live - spared * again for live, again in pairs)
    return MicrobatchCost(
        saved_bytes=probe.saved_bytes,
        transient_bytes=max((0, *trace)),
        forward=forward,
        backward=_work_minus(to_work(probe, tp, cp), forward),
        received_bytes=part.received_bytes,
        held_output_bytes=part.held_output_bytes,
        transient_trace=trace,
    )


def to_work(probe: ActivationProbe, tp: int, cp: int = 1) -> Work:
    """A probe's counts as the time model's `Work`: collectives by kind, over the mesh dimension they ran on
    (all-to-alls are expert parallelism's; in the (dp, cp, tp) mesh of a probe tp's groups have stride 1 and cp's
    stride tp), each with its full buffer's bytes."""
    collectives = []
    for c in probe.collectives:
        if c.group_size == 1:
            continue
        kind = _collective_kind(c.op)
        dim = "ep" if kind == "all_to_all" else "cp" if _is_cp(c, tp, cp) else "tp"
        nbytes = c.bytes * c.group_size if kind == "all_gather" else c.bytes  # the probe counts inputs
        collectives.append(Collective(kind, dim, nbytes))
    return Work(probe.flops, probe.other_bytes, probe.ops, tuple(collectives), probe.subclass_ops, probe.fp8_flops,
                probe.flops - probe.matmul_flops, probe.fp8_operand_elements)


def _is_cp(collective: ProbedCollective, tp: int, cp: int) -> bool:
    return cp > 1 and collective.group_size == cp and (tp == 1 or collective.group_stride == tp)


def _collective_kind(op: str) -> str:
    name = op.split(".")[-1].replace("_", "")
    for kind in ("allreduce", "allgather", "reducescatter", "alltoall"):
        if name.startswith(kind):
            return {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
                    "alltoall": "all_to_all"}[kind]  # fmt: skip
    raise ValueError(f"unknown collective {op}")


def _work_minus(a: Work, b: Work) -> Work:
    """`a` without `b` (b's collectives are a prefix-multiset of a's), one entry per collective run."""
    remaining: Counter[tuple] = Counter()
    for collectives, sign in ((a.collectives, 1), (b.collectives, -1)):
        for c in collectives:
            remaining[c.op, c.dim, c.bytes] += sign * c.count
    collectives = tuple(Collective(*key) for key, n in remaining.items() for _ in range(max(n, 0)))
    return Work(a.flops - b.flops, a.other_bytes - b.other_bytes, a.ops - b.ops, collectives,
                a.subclass_ops - b.subclass_ops, a.fp8_flops - b.fp8_flops, a.attention_flops - b.attention_flops,
                a.fp8_cast_elements - b.fp8_cast_elements)


def stage_shape(checked: CheckedLayout, pp_rank: int) -> list[tuple[int, bool, bool]]:
    """(blocks, is the first stage, is the last stage) of each stage chunk pipeline rank `pp_rank` holds."""
    if checked.pipeline is None:
        return [(checked.model_args.n_layers, True, True)]
    blocks = get_model_spec(checked.config.model.name).build.blocks
    chunks = []
    for stage in checked.pipeline.stage_ids(pp_rank):
        names = checked.pipeline.stage_modules[stage]
        count = sum(1 for name in names if name.startswith(f"{blocks}."))
        chunks.append((count, stage == 0, stage == checked.pipeline.num_stages - 1))
    return chunks
