"""The pipeline schedules, one row each: what config validation and `torchpre.parallel.pipeline` know about them.

The table lives below `torchpre.parallel` and imports no torch, so the config's dataclasses (which name the
choices for --help and validation) and the pipeline (which builds the schedules) read the same rows, and the
config needs neither torch nor the `parallel` package. A new schedule, or one torch adds to
`torch.distributed.pipelining.schedules`, is one `PipelineSchedule` row.
"""

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from torchpre.errors import ConfigError

SCHEDULE_KEY = "parallelism.pipeline_parallel_schedule"


def _all_forwards_first(p: int, m: int, v: int, r: int) -> int:
    """GPipe, LoopedBFS: every chunk-forward of the step runs before the first backward."""
    return v * m


@dataclass(frozen=True)
class PipelineSchedule:
    """One schedule's facts.

    torch_class: the class's name in `torch.distributed.pipelining.schedules`.
    multi_stage: a `PipelineScheduleMulti` (a rank may hold several stages) rather than a single-stage one.
    placement: "loop" puts stages r, r + pp, ... on rank r; "v" puts stages r and 2 pp - 1 - r (2 per rank).
    forward_only: `schedule.eval` runs it without backward actions (validation under pipelining).
    microbatches_per_stage: needs at least one microbatch per stage.
    rounds: runs microbatches in rounds of the pipeline degree (their count must split into equal rounds).
    aliases: other names that select it.
    zero_bubble: splits each backward into input (I) and weight (W) parts; the W parts fill the drain.
    in_flight: `(pp, microbatches, stages_per_rank, rank) -> count`, the most forwards whose activations the rank
        holds at once, in stage-chunk activations (see `in_flight_microbatches`).
    """

    name: str
    torch_class: str
    multi_stage: bool
    placement: Literal["loop", "v"] = "loop"
    forward_only: bool = True
    microbatches_per_stage: bool = False
    rounds: bool = False
    aliases: tuple[str, ...] = ()
    zero_bubble: bool = False
    in_flight: Callable[[int, int, int, int], int] = _all_forwards_first

    def bubble(self, pp: int, microbatches: int, stages_per_rank: int) -> float:
        """The idle fraction of each rank with equal stage times and free communication.

        p - 1 fill (and drain) slots around the rank's work: a slot is one stage chunk's forward + backward, and a
        rank does `stages_per_rank` chunks per microbatch, so (p - 1) / (v m + p - 1); GPipe and 1F1B are v = 1.
        Zero-bubble schedules fill the drain with weight backwards, leaving only p - 1 chunk-forwards of fill against
        3 v m chunk-slots of work (forward, input backward, weight backward, equal times): (p - 1) / (3 v m + p - 1).
        bench/pipeline_bubble.py measures GPipe, 1F1B, Interleaved1F1B and ZBVZeroBubble against these; LoopedBFS,
        InterleavedZeroBubble and DualPipeV take the same forms, unmeasured.
        """
        self.check_stages_per_rank(stages_per_rank)
        work = (3 if self.zero_bubble else 1) * stages_per_rank * microbatches
        return (pp - 1) / (work + pp - 1)

    def in_flight_microbatches(self, pp: int, microbatches: int, rank: int, stages_per_rank: int = 1) -> int:
        """The most stage-chunk forwards whose saved activations pipeline rank `rank` holds at once.

        The unit is one microbatch's activations of one of the rank's stages (a "chunk"): a rank holding v stages
        can hold up to v m of them. A forward adds one; a full backward (B) frees it, and so does the input backward
        (I) of zero-bubble schedules (the weight backward W keeps only the matmul inputs, not counted here). Read off
        torch's own action order (`pipeline_order`); tests/unit/test_schedule_theory.py checks each row's closed
        form against it.
        """
        self.check_stages_per_rank(stages_per_rank)
        if not 0 <= rank < pp:
            raise ValueError(f"pipeline rank {rank} is not in [0, {pp})")
        return self.in_flight(pp, microbatches, stages_per_rank, rank)

    def stages_per_rank(self, virtual_stages: int) -> int:
        """Stages each rank holds under parallelism.pipeline_parallel_virtual_stages = `virtual_stages`: 1 for
        single-stage schedules, 2 for V schedules, else `virtual_stages` (which of these the schedule accepts is
        `torchpre.parallel.pipeline.checked_stages_per_rank`'s to check)."""
        if not self.multi_stage:
            return 1
        return 2 if self.placement == "v" else virtual_stages

    def stage_ids(self, pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
        """The global stage indices held by `pp_rank`: r, r + pp, ... in a loop; r and 2 pp - 1 - r in a V."""
        if self.placement == "v":
            return [pp_rank, 2 * pp - 1 - pp_rank]
        return [pp_rank + k * pp for k in range(stages_per_rank)]

    def stage_rank(self, stage: int, pp: int) -> int:
        """The pp rank that holds global stage `stage`."""
        if self.placement == "v":
            return stage if stage < pp else 2 * pp - 1 - stage
        return stage % pp

    def check_stages_per_rank(self, stages_per_rank: int) -> None:
        expected = 1 if not self.multi_stage else 2 if self.placement == "v" else None
        if stages_per_rank < 1 or expected not in (None, stages_per_rank):
            count = expected or "a positive number of"
            raise ValueError(f"'{self.name}' holds {count} stages per rank, not {stages_per_rank}")


def _one_forward_one_backward(p: int, m: int, v: int, r: int) -> int:
    """1F1B: rank r runs p - r warm-up forwards, then one backward per forward."""
    return min(m, p - r)


def _interleaved(factor: int) -> Callable[[int, int, int, int], int]:
    """torch's interleaved warm-up (`_get_warmup_ops`): (v - 1) x the microbatches of a round, plus `factor` per hop
    from the last rank (2 for Interleaved1F1B, 1 for InterleavedZeroBubble), capped at all v m chunk-forwards; the
    first steady-state forward runs before the first backward, hence + 1."""

    def in_flight(p: int, m: int, v: int, r: int) -> int:
        rounds = max(1, m // p)
        warmup = (v - 1) * (m // rounds) + factor * (p - 1 - r)
        return min(warmup + 1, v * m)

    return in_flight


def _zbv(p: int, m: int, v: int, r: int) -> int:
    """ZB-V: rank r peaks at m + r + 1 chunk-forwards, capped at 2 p (the V's steady state) and at all of its
    2 m chunk-forwards."""
    return min(m + r + 1, 2 * p, 2 * m)


def _dualpipev(p: int, m: int, v: int, r: int) -> int:
    """DualPipeV (m >= 2 p): every rank peaks at 2 p + 1 chunk-forwards, the +1 being the forward half of an
    overlapped forward-backward pair, which torch runs before its backward half."""
    return 2 * p + 1


# torch 2.14's forward-only `schedule.eval` still runs the V schedules' backward actions, and their same-rank
# hand-off of input gradients fails ("can't steal_bwd_input ..."), hence forward_only=False.
SCHEDULES: tuple[PipelineSchedule, ...] = (
    PipelineSchedule("GPipe", "ScheduleGPipe", multi_stage=False, aliases=("AFAB",)),
    PipelineSchedule(
        "1F1B", "Schedule1F1B", multi_stage=False, microbatches_per_stage=True, in_flight=_one_forward_one_backward
    ),
    PipelineSchedule(
        "Interleaved1F1B", "ScheduleInterleaved1F1B", multi_stage=True, rounds=True, in_flight=_interleaved(2)
    ),
    PipelineSchedule("LoopedBFS", "ScheduleLoopedBFS", multi_stage=True),
    PipelineSchedule(
        "InterleavedZeroBubble",
        "ScheduleInterleavedZeroBubble",
        multi_stage=True,
        rounds=True,
        zero_bubble=True,
        in_flight=_interleaved(1),
    ),
    PipelineSchedule(
        "ZBVZeroBubble",
        "ScheduleZBVZeroBubble",
        multi_stage=True,
        placement="v",
        forward_only=False,
        microbatches_per_stage=True,
        zero_bubble=True,
        in_flight=_zbv,
    ),
    PipelineSchedule(
        "DualPipeV",
        "ScheduleDualPipeV",
        multi_stage=True,
        placement="v",
        forward_only=False,
        microbatches_per_stage=True,
        zero_bubble=True,
        in_flight=_dualpipev,
    ),
)

_BY_NAME: dict[str, PipelineSchedule] = {name: row for row in SCHEDULES for name in (row.name, *row.aliases)}
SCHEDULE_NAMES: tuple[str, ...] = tuple(_BY_NAME)


def get_schedule(name: str) -> PipelineSchedule:
    """The row for `name` or an alias of it; an unknown name is a ConfigError naming the closest one."""
    if name not in _BY_NAME:
        close = difflib.get_close_matches(name, SCHEDULE_NAMES, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigError(
            f"{SCHEDULE_KEY} = '{name}' is not a schedule.{hint} Choose one of: {', '.join(SCHEDULE_NAMES)}."
        )
    return _BY_NAME[name]


def names_where(**facts: object) -> list[str]:
    """The schedules (not aliases) whose rows have these facts, e.g. `names_where(placement="v")`."""
    return [row.name for row in SCHEDULES if all(getattr(row, key) == value for key, value in facts.items())]


def aliases_text() -> str:
    """E.g. "AFAB is GPipe", for help texts."""
    return ", ".join(f"{alias} is {row.name}" for row in SCHEDULES for alias in row.aliases)
