"""The global-batch ramp (`training.batch_rampup`, Megatron's `--rampup-batch-size`): the global batch a step trains
with, as a function of the samples consumed before it, so that it is the same under any layout and on a resume. The
key's three numbers are read and checked by `torchpre.config.training_schedule.ramp_values`."""

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchRamp:
    """The global batch starts at `start` sequences and grows by `increment` each time another
    samples / ((final - start) / increment) sequences have been consumed, until it reaches `final`
    (training.global_batch_size) after `samples` sequences."""

    start: int
    increment: int
    samples: int
    final: int

    def global_batch(self, consumed_samples: int) -> int:
        """The global batch of the step after `consumed_samples` sequences, by Megatron's formula (its floating-point
        division included, so that a run ported from Megatron ramps at the same steps)."""
        increments = (self.final - self.start) // self.increment
        if consumed_samples > self.samples or increments == 0 or self.samples == 0:
            return self.final
        per_increment = self.samples / increments
        return self.start + int(consumed_samples / per_increment) * self.increment

    def sizes(self) -> list[int]:
        """Every global batch the ramp trains with, smallest first."""
        return list(range(self.start, self.final + 1, self.increment))

    def indivisible_sizes(self, per_round: int) -> list[int]:
        """The sizes that a round of `per_round` sequences (local_batch_size x dp) does not divide."""
        return [size for size in self.sizes() if size % per_round]
