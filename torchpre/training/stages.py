"""The data stages of a run (`[[training.data_stages]]`): which data, at which sequence length, each step trains on.

A stage is a function of the step alone, and its data order is the order its data would have at the same global
sample positions in a run of that data from step 0 (seeded by training.seed): so where a run enters a stage does
not depend on the layout, and a stage that changes only seq_len continues the data exactly as a resume with another
training.seq_len does (`torchpre.training.batches`)."""

import bisect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchpre.config.job_config import DataStage, JobConfig
from torchpre.config.training_schedule import STAGES_KEY as KEY
from torchpre.config.training_schedule import check_data_stage, stage_name
from torchpre.errors import ConfigError, FieldError, TorchpreError, json_field, resolve_step
from torchpre.optim.lr_scheduler import decay_start_step

SAVED_KEY = "train.data_stages"  # where a checkpoint's state.json keeps the stages of the run that saved it


@dataclass(frozen=True)
class Stage:
    """A resolved stage: its number (0-based), name, first step, sequence length and mixture (shard folder ->
    weight; empty = the job's own data, training.dataset*)."""

    index: int
    name: str
    start_step: int
    seq_len: int
    mixture: dict[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        where = f"data stage {self.index + 1} ('{self.name}', start_step {self.start_step})"
        return f"{where}: {_mixture(self.mixture)}, seq_len {self.seq_len}"


class StageTable:
    """The stages of a run in order of their start steps, the first at step 0; one stage, the job's data at
    training.seq_len, when none are configured."""

    def __init__(self, stages: list[Stage]):
        self.stages = stages
        self._starts = [stage.start_step for stage in stages]

    @classmethod
    @resolve_step
    def from_config(cls, config: JobConfig) -> "StageTable":
        t = config.training
        if not t.data_stages:
            return cls([Stage(0, "stage-1", 0, t.seq_len)])
        stages = [_resolve(config, i, entry) for i, entry in enumerate(t.data_stages)]
        if stages[0].start_step != 0:
            raise ConfigError(
                f"{KEY}: the first stage ('{stages[0].name}') starts at step {stages[0].start_step}, but the run "
                "starts at step 0 with it. Give it start_step = 0 (or no start at all)."
            )
        for before, after in zip(stages, stages[1:]):
            if after.start_step <= before.start_step:
                raise ConfigError(
                    f"{KEY}: stage {after.index + 1} ('{after.name}') starts at step {after.start_step}, not after "
                    f"stage {before.index + 1} ('{before.name}') at step {before.start_step}: stages overlap or go "
                    "backwards. List them in the order they run, each starting later than the one before."
                )
        last = stages[-1]
        if last.start_step >= t.steps:
            raise ConfigError(
                f"{KEY}: stage {last.index + 1} ('{last.name}') starts at step {last.start_step}, but the run ends "
                f"after training.steps = {t.steps}, so it would never train. Start it earlier or raise training.steps."
            )
        return cls(stages)

    def at(self, step: int) -> Stage:
        """The stage that the (0-based) step `step` trains in."""
        return self.stages[bisect.bisect_right(self._starts, step) - 1]

    @property
    def max_seq_len(self) -> int:
        return max(stage.seq_len for stage in self.stages)

    def record(self) -> list[dict[str, Any]]:
        """The stages as JSON values, for the checkpoint's "train" state (`from_record` reads them back)."""
        return [
            {"name": s.name, "start_step": s.start_step, "seq_len": s.seq_len, "mixture": dict(s.mixture)}
            for s in self.stages
        ]

    @classmethod
    def from_record(cls, record: object) -> "StageTable":
        """The table `record` (from a checkpoint, so from anyone) holds, every field checked: a FieldError names
        the first one that is missing, of the wrong type, or out of range (stages must start at step 0 and go
        forward, with a positive seq_len and non-negative finite weights)."""
        if not isinstance(record, list) or not record:
            raise FieldError("it is not a non-empty array of stages")
        stages = []
        for index, entry in enumerate(record):
            where = f"[{index}]"
            start, seq_len = json_field(entry, "start_step", int, where), json_field(entry, "seq_len", int, where)
            mixture = json_field(entry, "mixture", dict, where)
            weights = {folder: json_field(mixture, folder, float, f"{where}.mixture") for folder in mixture}
            if (not stages and start != 0) or (stages and start <= stages[-1].start_step):
                raise FieldError(f"'{where}.start_step' is {start}: stages start at step 0 and go forward")
            if seq_len <= 0 or not all(0 <= weight < float("inf") for weight in weights.values()):
                raise FieldError(f"'{where}' holds a seq_len of {seq_len} or a weight that is no finite number >= 0")
            stages.append(Stage(index, json_field(entry, "name", str, where), start, seq_len, weights))
        return cls(stages)

    def data_between(self, first: int, end: int) -> list[tuple[int, int, dict[str, float]]]:
        """What steps [first, end) train on: (first step, seq_len, mixture) of each stretch, names left out."""
        starts = sorted({first, *(stage.start_step for stage in self.stages if first < stage.start_step < end)})
        return [(start, self.at(start).seq_len, self.at(start).mixture) for start in starts if start < end]


def saved_stages(record: object, step_dir: Path) -> StageTable | None:
    """The stages of the run that saved `step_dir`, from the value `record` its state.json holds at SAVED_KEY (data,
    never its config.toml, which torchpre does not read back); None when it holds none (a checkpoint written before
    the stages were saved). A malformed value is an error naming the file and the key."""
    if record is None:
        return None
    try:
        return StageTable.from_record(record)
    except FieldError as error:
        raise TorchpreError(
            f"{step_dir / 'state.json'}: {SAVED_KEY} is no table of data stages ({error}). torchpre writes it as a "
            "list of stages; this checkpoint was altered, or written by another tool. Resume from another checkpoint."
        ) from None


def stages_change(saved: StageTable, current: StageTable, step: int, steps: int) -> tuple[list[str], list[str]]:
    """(warnings, notes) for a resume at `step` (of `steps`) whose stages differ from the checkpoint's run's.

    A change to the steps already taken is a warning, not an error: they were trained as they were, and a moved
    shard folder changes a mixture's paths without changing its data; the resumed run reads this config's data
    from `step` on. A change to what comes (a later stage's mixture, seq_len or start) is the point of stages:
    a note."""
    warnings, notes = [], []
    if saved.data_between(0, step) != current.data_between(0, step):
        warnings.append(
            f"{KEY} differ from those of the run that saved step {step}, for steps it already took: it trained "
            f"{_stretches(saved.data_between(0, step))}, this config says {_stretches(current.data_between(0, step))}. "
            f"Those steps stay as trained; from step {step} on the run reads this config's data. To record the "
            f"change in the config, keep the earlier stages as they were and add a stage with start_step = {step}."
        )
    later_saved, later_current = saved.data_between(step, steps), current.data_between(step, steps)
    if later_saved != later_current:
        notes.append(
            f"{KEY}: the steps from {step} on change from {_stretches(later_saved)} to {_stretches(later_current)} "
            "(they have not been taken yet, so the run takes them as configured now)"
        )
    return warnings, notes


def _stretches(data: list[tuple[int, int, dict[str, float]]]) -> str:
    return "; ".join(f"from step {start}: {_mixture(weights)} at seq_len {seq_len}" for start, seq_len, weights in data)


def _mixture(weights: dict[str, float]) -> str:
    if not weights:
        return "the job's data"
    return "{" + ", ".join(f"{folder}={weight:g}" for folder, weight in weights.items()) + "}"


def _resolve(config: JobConfig, index: int, entry: DataStage) -> Stage:
    """One `[[training.data_stages]]` table as a `Stage`, its values checked and its start step resolved."""
    t, s = config.training, config.lr_scheduler
    check_data_stage(config, index, entry)
    name = stage_name(index, entry)
    if entry.start_step is not None:
        start = entry.start_step
    elif entry.start_fraction is not None:
        start = round(entry.start_fraction * t.steps)
    elif entry.start_at_decay:
        start = decay_start_step(steps=t.steps, warmup_steps=s.warmup_steps, decay_ratio=s.decay_ratio)
        if start >= t.steps:
            raise ConfigError(
                f"{KEY} stage {index + 1} ('{name}') starts at the decay of the LR schedule, but "
                f"lr_scheduler.decay_ratio = {s.decay_ratio} never decays. Set a decay_ratio > 0 or give the stage a "
                "start_step."
            )
    else:
        start = 0
    return Stage(index, name, start, entry.seq_len or t.seq_len, dict(entry.mixture))
