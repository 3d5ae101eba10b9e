"""The ZeRO stages, one row each: what each shards over data parallelism. The one place a stage number means
anything; everything else asks a row (or `torchpre.parallel.data_parallel.DataParallel`, built on it) by capability.

Like the pipeline schedules' table (`schedules.py`), it imports no torch, so the config's checks and the planner's
time model read the same rows as the training code.
"""

from dataclasses import dataclass

from torchpre.errors import ConfigError


@dataclass(frozen=True)
class ZeroStage:
    """What a ZeRO stage shards over the data-parallel ranks; `summary` names it in messages."""

    number: int
    shards_optimizer_state: bool
    shards_gradients: bool
    shards_parameters: bool
    summary: str


ZERO_STAGES = {
    0: ZeroStage(0, False, False, False, "0 (replicated state)"),
    1: ZeroStage(1, True, False, False, "1 (optimizer state sharded over DP)"),
    2: ZeroStage(2, True, True, False, "2 (gradients sharded over DP too)"),
    3: ZeroStage(3, True, True, True, "3 (parameters, gradients and state sharded over DP by FSDP2)"),
}


def zero_stage(number: int) -> ZeroStage:
    """The row of `optimizer.zero_stage = number`; an unknown stage is a ConfigError listing the valid ones."""
    if number not in ZERO_STAGES:
        raise ConfigError(
            f"optimizer.zero_stage = {number}: use {', '.join(stage.summary for stage in ZERO_STAGES.values())}."
        )
    return ZERO_STAGES[number]
