"""The layouts a planner considers: every way to split a job over N GPUs that torchpre's own start-up checks
accept, each written as the config a real run of it would use."""

import copy
import itertools
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from torchpre.assembly.args import model_args
from torchpre.assembly.tokenizer import tokenizer_path
from torchpre.config.job_config import JobConfig
from torchpre.data.tokenizer import Tokenizer, load_tokenizer
from torchpre.errors import ConfigError
from torchpre.models.args import ModelArgs
from torchpre.models.registry import ModelSpec, get_model_spec
from torchpre.parallel.pipeline import PipelinePlan
from torchpre.step_rules.zero_stages import ZERO_STAGES
from torchpre.training.preflight import preflight

AC_MODES = ("none", "selective", "full")
MICROBATCH_SIZES = (1, 2, 4, 8)
TRY_WHOLE_SHARE = True  # also each rank's whole share in one microbatch (`microbatch_sizes`)
# Pipeline schedules the planner compares (the others are variants of these), with the stages each rank holds.
PLANNED_SCHEDULES = (("1F1B", 1), ("GPipe", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2))


@dataclass(frozen=True)
class Layout:
    """One way to run the job: the parallel degrees, ZeRO stage, activation checkpointing, microbatch size and
    (with pipelining) the schedule and the stages each rank holds. `cp` splits each sequence over cp ranks that read
    the same sequences (dp counts the sequences' readers)."""

    dp: int
    tp: int
    pp: int
    ep: int = 1
    zero_stage: int = 1
    activation_checkpoint: str = "none"
    microbatch_size: int = 1
    schedule: str = ""  # "" without pipelining
    virtual_stages: int = 1
    cp: int = 1

    def apply(self, base: JobConfig) -> JobConfig:
        """`base` (model, data, batch, precision) with this layout's keys set, as a user would write them.

        Without pipelining a microbatch is training.local_batch_size (gradient accumulation makes up the global
        batch); with it, each DP rank takes its whole share of the batch per step and the schedule cuts it into
        parallelism.pipeline_parallel_microbatch_size pieces.
        """
        config = copy.deepcopy(base)
        p, t = config.parallelism, config.training
        p.data_parallel_degree, p.tensor_parallel_degree, p.pipeline_parallel_degree = self.dp, self.tp, self.pp
        p.expert_parallel_degree = self.ep
        p.context_parallel_degree = self.cp
        p.enable_sequence_parallel = self.tp > 1
        p.enable_loss_parallel = self.tp > 1
        config.optimizer.zero_stage = self.zero_stage
        config.activation_checkpoint.mode = self.activation_checkpoint
        config.activation_checkpoint.selective_ac_option = "op"
        if self.activation_checkpoint != "none":  # checkpointed blocks recompute the MLP's activation already
            config.activation_checkpoint.recompute_mlp_activation = False
        if self.pp > 1:
            t.local_batch_size = t.global_batch_size // self.dp
            p.pipeline_parallel_schedule = self.schedule
            p.pipeline_parallel_virtual_stages = self.virtual_stages
            p.pipeline_parallel_microbatch_size = self.microbatch_size
        else:
            t.local_batch_size = self.microbatch_size
        return config

    def describe(self) -> str:
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}"] + ([f"ep{self.ep}"] if self.ep > 1 else [])
        parts += [f"cp{self.cp}"] if self.cp > 1 else []
        schedule = f" {self.schedule}" + (f" v{self.virtual_stages}" if self.virtual_stages > 1 else "")
        return (
            f"{' x '.join(parts)} zero{self.zero_stage} ac:{self.activation_checkpoint} mb{self.microbatch_size}"
            + (schedule if self.pp > 1 else "")
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "dp": self.dp,
            "tp": self.tp,
            "pp": self.pp,
            "ep": self.ep,
            "zero_stage": self.zero_stage,
            "activation_checkpoint": self.activation_checkpoint,
            "microbatch_size": self.microbatch_size,
            "schedule": self.schedule or None,
            "virtual_stages": self.virtual_stages,
            "cp": self.cp,
        }


@dataclass(frozen=True)
class CheckedLayout:
    """A layout that start-up accepts, with what start-up derived from it."""

    layout: Layout
    config: JobConfig
    model_args: ModelArgs
    accumulation_steps: int
    pipeline: PipelinePlan | None

    @property
    def microbatches(self) -> int:
        """Microbatches each DP rank runs per step (pipeline microbatches, or gradient-accumulation steps)."""
        return self.pipeline.n_microbatches if self.pipeline else self.accumulation_steps


def check(layout: Layout, base: JobConfig, world_size: int) -> CheckedLayout:
    """`layout` applied to `base`, through the checks a real start-up runs before joining the process group
    (`torchpre.training.job.preflight`): raises their ConfigError when the layout is impossible."""
    config = layout.apply(base)
    checked = preflight(config, world_size, cached_tokenizer(tokenizer_path(config)), cached_stage_modules)
    return CheckedLayout(layout, config, checked.model_args, checked.batches.accumulation_steps, checked.pipeline)


def candidates(
    base: JobConfig, gpus: int, gpus_per_node: int, experts: bool = False, context_parallel: bool = False
) -> Iterator[Layout]:
    """Every combination the planner considers: tp within a node, pp and ep dividing the rest, each ZeRO stage,
    AC mode and microbatch size, and every planned schedule when pipelining. Not yet checked. With
    `context_parallel`, the same with each cp > 1 that divides the rest and cuts every sequence into 2 x cp equal
    chunks (and only those)."""
    global_batch, seq_len = base.training.global_batch_size, base.training.seq_len
    for tp in _divisors(gpus_per_node):
        for pp in _divisors(gpus // tp) if gpus % tp == 0 else ():
            cps = [c for c in _divisors(gpus // (tp * pp)) if c > 1 and seq_len % (2 * c) == 0]
            for cp in cps if context_parallel else [1]:
                dp = gpus // (tp * pp * cp)
                schedules = PLANNED_SCHEDULES if pp > 1 else (("", 1),)
                eps = _divisors(dp * cp) if experts else (1,)
                for ep, zero, ac, mb, (schedule, v) in itertools.product(
                    eps, ZERO_STAGES, AC_MODES, microbatch_sizes(global_batch, dp, pp), schedules
                ):
                    if global_batch % (dp * mb):
                        continue
                    yield Layout(dp, tp, pp, ep, zero, ac, mb, schedule, v, cp)


def microbatch_sizes(global_batch: int, dp: int, pp: int) -> tuple[int, ...]:
    """The microbatch sizes a layout of `dp` data-parallel ranks and `pp` stages is tried at: `MICROBATCH_SIZES`, and
    without pipelining each rank's whole share of the batch in one microbatch (no gradient accumulation) where that
    share is larger: a run that fits it skips accumulation's extra passes over the weights (torchtitan's 70B on 256
    H100s runs 16 sequences per rank in one microbatch). Under pipelining the share is cut into microbatches anyway,
    and one per step would leave every stage but one idle."""
    share = global_batch // dp
    if not TRY_WHOLE_SHARE or pp > 1 or global_batch % dp or share <= max(MICROBATCH_SIZES):
        return MICROBATCH_SIZES
    return (*MICROBATCH_SIZES, share)


def valid_layouts(
    base: JobConfig, gpus: int, gpus_per_node: int, context_parallel: bool = False
) -> tuple[list[CheckedLayout], Counter[str]]:
    """The candidates start-up accepts (with `context_parallel`, those with cp > 1), and the messages of those it
    refused with how many it refused with each. What is wrong whatever the layout (the model's name, its flavor,
    the batch) is an error at once."""
    if base.training.global_batch_size < 1:
        raise ConfigError(
            "The planner needs training.global_batch_size (sequences per step): set it to the batch you will train."
        )
    spec = get_model_spec(base.model.name)
    if spec.args_from_job is not None:
        raise ConfigError(
            f"model.name = '{base.model.name}': the planner sizes a model by cutting its flavor to fewer blocks, and "
            "this family's args come from elsewhere (model.hf_config), not a flavor. `--job.dry_run` reports the "
            "per-rank memory of a given layout."
        )
    model_args(base, cached_tokenizer(tokenizer_path(base)))  # a misnamed flavor, or a vocabulary that cannot be
    valid, refusals = [], Counter()
    experts = spec.parallel.expert_parallel is not None
    for layout in candidates(base, gpus, gpus_per_node, experts, context_parallel):
        try:
            valid.append(_dense_blocks_first(check(layout, base, gpus)))
        except ConfigError as error:
            refusals[str(error)] += 1
    return valid, refusals


def _dense_blocks_first(checked: CheckedLayout) -> CheckedLayout:
    """`checked`, if the first pipeline stage holds the model's dense first blocks (the MoE families'
    `first_k_dense`): the planner costs a stage as its ends plus blocks of one kind (`torchpre.planner.stage_costs`),
    the dense blocks among the first stage's ends."""
    dense = checked.model_args.first_k_dense
    if checked.pipeline is None or dense <= 1:
        return checked
    blocks = get_model_spec(checked.config.model.name).build.blocks
    first = sum(1 for name in checked.pipeline.stage_modules[0] if name.startswith(f"{blocks}."))
    if first < dense:
        raise ConfigError(
            f"The first pipeline stage holds {first} blocks, fewer than the model's first_k_dense = {dense} dense "
            "blocks: the planner costs the dense blocks as part of the first stage. Use fewer pipeline stages."
        )
    return checked


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@cache
def cached_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer at `path` (`torchpre.assembly.tokenizer.tokenizer_path`), loaded once for every layout the planner
    checks."""
    return load_tokenizer(path)


_STAGES: dict[tuple, list[list[str]] | ConfigError] = {}


def cached_stage_modules(
    spec: ModelSpec, args: ModelArgs, stages: int, split_points: Sequence[str], **counts: int
) -> list[list[str]]:
    """`spec.pipeline_stages`, once per model and stage count, refusals included (it builds the model on meta:
    ~1 s at 405B)."""
    key = (repr(args), stages, tuple(split_points), tuple(sorted(counts.items())))
    if key not in _STAGES:
        try:
            _STAGES[key] = spec.pipeline_stages(args, stages, split_points, **counts)
        except ConfigError as error:
            _STAGES[key] = error
    if isinstance(_STAGES[key], ConfigError):
        raise _STAGES[key]
    return _STAGES[key]
