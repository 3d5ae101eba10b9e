"""What each optimizer step trains on: its global batch (a `BatchRamp` of the samples consumed before it, or the
job's fixed batch), the microbatches each data-parallel rank accumulates for it, and its data stage (a `StageTable`
of the step, whose seq_len it runs at). A function of (step, consumed samples) and the config, never of the layout
beyond the data-parallel degree, so every layout and every resume takes the same steps."""

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from torchpre.config.job_config import JobConfig
from torchpre.config.training_schedule import RAMP_KEY, ramp_values
from torchpre.errors import ConfigError, resolve_step
from torchpre.step_rules.batch import BatchSizes
from torchpre.step_rules.ramp import BatchRamp
from torchpre.training.batches import kept_global_batch
from torchpre.training.stages import Stage, StageTable


@dataclass(frozen=True)
class StepShape:
    """One step's batch sizes (at its stage's seq_len) and its data stage."""

    sizes: BatchSizes
    stage: Stage


class StepPlan:
    """`at(step, consumed_samples)`: the `StepShape` of a step. `base` is the job's global batch in sequences of
    training.seq_len (the ramp's end); a stage at another seq_len keeps as many sequences, or under
    training.global_batch_unit = 'tokens' as many tokens (`kept_global_batch`, the rule of a resume at another
    seq_len)."""

    def __init__(self, base: BatchSizes, ramp: BatchRamp | None, stages: StageTable, dp: int, unit: str):
        self.base, self.ramp, self.stages, self.dp, self.unit = base, ramp, stages, dp, unit

    @classmethod
    @resolve_step
    def from_config(cls, config: JobConfig, base: BatchSizes, stages: StageTable, dp: int) -> "StepPlan":
        """The plan of `base` (the job's batch sizes), training.batch_rampup and `stages`; refuses a ramp whose sizes
        a round of training.local_batch_size x `dp` sequences does not divide."""
        t = config.training
        values = ramp_values(t.batch_rampup, t.global_batch_size)
        ramp = None if values is None else BatchRamp(*values, t.global_batch_size)
        per_round = t.local_batch_size * dp
        bad = ramp.indivisible_sizes(per_round) if ramp is not None else []
        if bad:
            raise ConfigError(
                f"{RAMP_KEY} = \"{ramp.start},{ramp.increment},{ramp.samples}\" trains with global batches "
                f"{_listed(ramp.sizes())}, and "
                f"{_listed(bad)} are not divisible by training.local_batch_size x data-parallel degree = "
                f"{t.local_batch_size} x {dp} = {per_round}. Use a start and an increment that are multiples of "
                f"{per_round} (or a smaller local_batch_size)."
            )
        return cls(base, ramp, stages, dp, t.global_batch_unit)

    @property
    def phased(self) -> bool:
        """Whether the steps differ at all (a ramp or more than one stage)."""
        return self.ramp is not None or len(self.stages.stages) > 1

    def at(self, step: int, consumed_samples: int) -> StepShape:
        stage = self.stages.at(step)
        batch = self.ramp.global_batch(consumed_samples) if self.ramp else self.base.global_batch_size
        batch = self._in_stage(batch, stage)
        local = self.base.local_batch_size
        return StepShape(BatchSizes(batch, batch // (local * self.dp), local, stage.seq_len), stage)

    def walk(self, first_step: int = 0, consumed_samples: int = 0) -> Iterator[tuple[int, int, StepShape]]:
        """(step, samples consumed before it, its shape) from `first_step` on, until every later step repeats the
        last shape (past the ramp and the last stage's start)."""
        step, consumed = first_step, consumed_samples
        last_start = self.stages.stages[-1].start_step
        while True:
            shape = self.at(step, consumed)
            yield step, consumed, shape
            ramp_done = self.ramp is None or consumed > self.ramp.samples
            if ramp_done and step >= last_start:
                return
            step, consumed = step + 1, consumed + shape.sizes.global_batch_size

    def first_sample(self, stage: Stage) -> int:
        """The global sample a run of this config enters `stage` at (its first step's consumed samples)."""
        for step, consumed, _ in self.walk():
            if step == stage.start_step:
                return consumed
        return 0

    def peak(self, steps: int) -> tuple[int, int]:
        """(the most sequences a DP rank runs in one step, the longest seq_len) over the run's `steps` steps: the
        shapes a memory estimate must hold (they need not occur in the same step)."""
        shapes = [shape.sizes for step, _, shape in self.walk() if step < steps] or [self.at(0, 0).sizes]
        return max(s.local_batch_size * s.accumulation_steps for s in shapes), max(s.seq_len for s in shapes)

    @resolve_step
    def check(self, steps: int, check_microbatches: Callable[[int], None]) -> None:
        """Every shape the run takes in `steps` steps, checked before any work: whole rounds of
        local_batch_size x dp, whole sequences under 'tokens', and `check_microbatches(sequences per DP rank)`
        (the pipeline schedule's own rules) for each distinct batch."""
        seen: set[tuple[int, int]] = set()
        for step, consumed, shape in self.walk():
            if step >= steps:
                break
            stage, sizes = shape.stage, shape.sizes
            ramping = self.ramp is not None and consumed <= self.ramp.samples
            if ramping and self.unit == "tokens" and stage.seq_len != self.base.seq_len:
                raise ConfigError(
                    f"{RAMP_KEY} is still ramping (in sequences) at step {step}, where {stage.describe()} changes the "
                    "sequence length under training.global_batch_unit = 'tokens'. End the ramp before that stage "
                    "(fewer ramp samples) or set global_batch_unit = 'sequences'."
                )
            key = (sizes.global_batch_size, sizes.seq_len)
            if key in seen:
                continue
            seen.add(key)
            per_round = sizes.local_batch_size * self.dp
            if sizes.global_batch_size % per_round:
                raise ConfigError(
                    f"At step {step} ({stage.describe()}) the global batch is {sizes.global_batch_size} sequences, "
                    f"not divisible by training.local_batch_size x data-parallel degree = {sizes.local_batch_size} x "
                    f"{self.dp} = {per_round}. Choose sizes (training.global_batch_size, {RAMP_KEY}, the stages' "
                    "seq_len) that keep it a multiple."
                )
            check_microbatches(sizes.local_batch_size * sizes.accumulation_steps)

    def warnings(self, steps: int) -> list[str]:
        """What the run's config does that a user may not expect, though it runs as configured: a ramp over no
        samples (Megatron accepts it: the final batch from the first step), and a ramp still growing, counted in
        sequences, when a stage changes the sequence length within the run's `steps` steps."""
        found = []
        if self.ramp is not None and self.ramp.samples == 0:
            found.append(
                f'{RAMP_KEY} = "{self.ramp.start},{self.ramp.increment},0" ramps over 0 samples: every step trains '
                f"with the final global batch of {self.ramp.final} sequences, as without a ramp. Give the samples "
                "the ramp should take, or leave training.batch_rampup empty."
            )
        ramp_end = self.ramp.samples if self.ramp is not None else -1
        for step, consumed, shape in self.walk():
            if step >= steps or consumed > ramp_end:
                break
            if shape.stage.seq_len != self.base.seq_len:
                found.append(
                    f"{RAMP_KEY} is still ramping at step {step} ({consumed} of its {self.ramp.samples} samples), "
                    f"where {shape.stage.describe()} (training.seq_len = {self.base.seq_len}): the ramp counts "
                    f"sequences, so from there its batches hold {shape.stage.seq_len}-token sequences. End the ramp "
                    "before that stage (fewer ramp samples) to ramp at one sequence length."
                )
                break
        return found

    def _in_stage(self, batch: int, stage: Stage) -> int:
        kept = kept_global_batch(batch, self.base.seq_len, stage.seq_len, self.unit)
        if kept is None:
            raise ConfigError(
                f"{stage.describe()}: a global batch of {batch} sequences x {self.base.seq_len} tokens, which "
                f"training.global_batch_unit = 'tokens' keeps, is no whole number of {stage.seq_len}-token "
                "sequences. Choose a seq_len that divides it, or set global_batch_unit = 'sequences'."
            )
        return kept


def _listed(sizes: list[int]) -> str:
    return ", ".join(map(str, sizes[:6])) + (f", ... ({len(sizes)} in all)" if len(sizes) > 6 else "")
