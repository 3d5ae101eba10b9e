"""Per-parameter factors on the optimizer's learning rate, weight decay and eps, as a parametrization sets them (µP,
CompleteP: `torchpre.models.parametrization`), turned into param groups.

The groups are those of the whole model, in a fixed order, on every rank: a pipeline stage that holds no parameter of
a group keeps it empty, so that the LR schedule's per-group state (saved by one rank) means the same on every rank
and reloads under any layout.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

GroupKey = tuple[bool, float, float, float]  # decayed (a matrix), then the lr, weight decay and eps factors


@dataclass(frozen=True)
class ParamScales:
    """`factors(name, shape)`: the (lr, weight decay, eps) factors of the parameter `name` whose whole (global) shape
    is `shape`; `shapes`: (name, global shape) of every parameter of the whole model, which fixes the groups."""

    factors: Callable[[str, Sequence[int]], tuple[float, float, float]]
    shapes: Sequence[tuple[str, tuple[int, ...]]]

    def key(self, name: str, shape: Sequence[int]) -> GroupKey:
        """The group of the parameter `name` of global shape `shape`."""
        return (len(shape) >= 2, *self.factors(name, shape))

    def keys(self) -> list[GroupKey]:
        """Every group of the whole model, in the order its parameters first appear."""
        return list(dict.fromkeys(self.key(name, shape) for name, shape in self.shapes))
