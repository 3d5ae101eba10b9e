"""A number key's valid values, declared with its field (`_option(..., bound=at_least(1))` in job_config.py) and
checked for every field of every section by `check_bounds`, so a key's range lives next to its help."""

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torchpre.errors import ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


@dataclass(frozen=True)
class Bound:
    """Values in [low, high] (an end left out where `low_open`/`high_open`), finite, or one of `also` (a value with
    a meaning of its own, e.g. -1 = derived from another key). `message` replaces the default "it must be ..."
    where the range alone would not tell the user what to do."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    also: tuple[float | None, ...] = ()
    message: str = ""

    def admits(self, value: float | None) -> bool:
        if value in self.also:
            return True
        if not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def describe(self) -> str:
        """The range in words: "at least 1", "positive", "in [0, 1)"."""
        if self.high == math.inf:
            return "positive" if (self.low, self.low_open) == (0, True) else f"at least {self.low}"
        return f"in {'(' if self.low_open else '['}{self.low}, {self.high}{')' if self.high_open else ']'}"

    def check(self, key: str, value: float) -> None:
        if not self.admits(value):
            raise ConfigError(f"{key} = {value}: {self.message or f'it must be {self.describe()}.'}")


def at_least(minimum: int, message: str = "", also: tuple[float | None, ...] = ()) -> Bound:
    return Bound(low=minimum, also=also, message=message)


def positive(message: str = "") -> Bound:
    return Bound(low=0, low_open=True, message=message)


def between(low: float, high: float, *, high_open: bool = False, low_open: bool = False, message: str = "") -> Bound:
    return Bound(low=low, high=high, low_open=low_open, high_open=high_open, message=message)


def check_bounds(section: "DataclassInstance", prefix: str) -> None:
    """Checks every field of the dataclass `section` that declares a bound (`metadata["bound"]`), named as
    `prefix` + its name ("training." for a section's keys, "--" for generation's flags)."""
    for field in dataclasses.fields(section):
        bound = field.metadata.get("bound")
        if bound is not None:
            bound.check(f"{prefix}{field.name}", getattr(section, field.name))
