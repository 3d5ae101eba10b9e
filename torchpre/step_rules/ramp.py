"""The global-batch ramp (`training.batch_rampup`, Megatron's `--rampup-batch-size`): the global batch a step trains
with, as a function of the samples consumed before it, so that it is the same under any layout and on a resume."""

from dataclasses import dataclass

from torchpre.errors import ConfigError

KEY = "training.batch_rampup"


def ramp_values(text: str, final: int) -> tuple[int, int, int] | None:
    """(start, increment, samples) of the ramp `text` ("start,increment,samples") towards the global batch `final`;
    None for "" (no ramp)."""
    if not text.strip():
        return None
    usage = f'{KEY} = "{text}": expected "start,increment,samples", three integers (e.g. "16,16,1000000")'
    try:
        start, increment, samples = (int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"{usage}.") from None
    if start < 1 or increment < 1 or samples < 0:
        raise ConfigError(f"{usage}: start and increment must be at least 1, samples at least 0.")
    if final == -1:
        raise ConfigError(
            f"{KEY} ramps the global batch up to training.global_batch_size, which is -1 (derived): set "
            "training.global_batch_size to the batch the ramp ends at."
        )
    if start > final:
        raise ConfigError(
            f"{KEY} starts at {start} sequences, more than training.global_batch_size = {final}: a ramp grows "
            "the batch, so start must be at most the global batch."
        )
    if (final - start) % increment:
        raise ConfigError(
            f"{KEY} grows from {start} by {increment}, which never reaches training.global_batch_size = "
            f"{final}: choose an increment that divides {final} - {start} = {final - start}."
        )
    return start, increment, samples


@dataclass(frozen=True)
class BatchRamp:
    """The global batch starts at `start` sequences and grows by `increment` each time another
    samples / ((final - start) / increment) sequences have been consumed, until it reaches `final`
    (training.global_batch_size) after `samples` sequences."""

    start: int
    increment: int
    samples: int
    final: int

    @classmethod
    def parse(cls, text: str, final: int) -> "BatchRamp | None":
        """The ramp `text` ("start,increment,samples") describes towards the global batch `final`; None for ""."""
        values = ramp_values(text, final)
        return None if values is None else cls(*values, final)

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

    def check_divisible(self, local_batch_size: int, dp: int) -> None:
        """Refuses a ramp whose sizes a round of local_batch_size x dp sequences does not divide."""
        per_round = local_batch_size * dp
        bad = [size for size in self.sizes() if size % per_round]
        if bad:
            raise ConfigError(
                f"{KEY} = \"{self.start},{self.increment},{self.samples}\" trains with global batches "
                f"{_listed(self.sizes())}, and {_listed(bad)} are not divisible by training.local_batch_size x "
                f"data-parallel degree = {local_batch_size} x {dp} = {per_round}. Use a start and an increment that "
                f"are multiples of {per_round} (or a smaller local_batch_size)."
            )


def _listed(sizes: list[int]) -> str:
    return ", ".join(map(str, sizes[:6])) + (f", ... ({len(sizes)} in all)" if len(sizes) > 6 else "")
