"""The pipeline schedules, one row each: what config validation and `torchpre.parallel.pipeline` know about them.

The table lives below `torchpre.parallel` and imports no torch, so the config's dataclasses (which name the
choices for --help and validation) and the pipeline (which builds the schedules) read the same rows, and the
config needs neither torch nor the `parallel` package. A new schedule, or one torch adds to
`torch.distributed.pipelining.schedules`, is one `PipelineSchedule` row.
"""

import difflib
from dataclasses import dataclass
from typing import Literal

from torchpre.errors import ConfigError

SCHEDULE_KEY = "parallelism.pipeline_parallel_schedule"


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
    """

    name: str
    torch_class: str
    multi_stage: bool
    placement: Literal["loop", "v"] = "loop"
    forward_only: bool = True
    microbatches_per_stage: bool = False
    rounds: bool = False
    aliases: tuple[str, ...] = ()


# torch 2.14's forward-only `schedule.eval` still runs the V schedules' backward actions, and their same-rank
# hand-off of input gradients fails ("can't steal_bwd_input ..."), hence forward_only=False.
SCHEDULES: tuple[PipelineSchedule, ...] = (
    PipelineSchedule("GPipe", "ScheduleGPipe", multi_stage=False, aliases=("AFAB",)),
    PipelineSchedule("1F1B", "Schedule1F1B", multi_stage=False, microbatches_per_stage=True),
    PipelineSchedule("Interleaved1F1B", "ScheduleInterleaved1F1B", multi_stage=True, rounds=True),
    PipelineSchedule("LoopedBFS", "ScheduleLoopedBFS", multi_stage=True),
    PipelineSchedule("InterleavedZeroBubble", "ScheduleInterleavedZeroBubble", multi_stage=True, rounds=True),
    PipelineSchedule(
        "ZBVZeroBubble",
        "ScheduleZBVZeroBubble",
        multi_stage=True,
        placement="v",
        forward_only=False,
        microbatches_per_stage=True,
    ),
    PipelineSchedule(
        "DualPipeV",
        "ScheduleDualPipeV",
        multi_stage=True,
        placement="v",
        forward_only=False,
        microbatches_per_stage=True,
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
