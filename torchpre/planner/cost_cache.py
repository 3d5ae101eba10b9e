"""Each distinct piece of a search measured once, found by the few layout fields it depends on.

The layouts of one search share their model, batch and precision and differ only in the fields `Layout.apply`
sets; each kind of measurement depends on a few of them. Looking pieces up by those fields spares every layout
the copy and serialization of its config that `torchpre.planner.stage_costs` keys its own caches on (a search of
30,000 layouts made 120,000 of them, ~4 ms each). `tests/unit/test_plan.py` checks that a search predicts
every layout as `predict` does alone.
"""

from collections.abc import Callable
from typing import Any, TypeVar

from torchpre.config.job_config import JobConfig
from torchpre.planner.layout_space import CheckedLayout, Layout
from torchpre.planner.stage_costs import Pieces, StepTransient, affine, microbatch_pieces, state_pieces, step_transient

T = TypeVar("T")


class Measured:
    """The pieces of one search's layouts, by key (`state_key`, `microbatch_key`)."""

    def __init__(self) -> None:
        self._found: dict[tuple, Any] = {}

    def __len__(self) -> int:
        return len(self._found)

    def found(self) -> dict[tuple, Any]:
        """The pieces found so far, by key (a view)."""
        return self._found

    def update(self, found: dict[tuple, Any]) -> None:
        """Adds pieces found elsewhere (a worker process's: `torchpre.planner.workers`)."""
        self._found.update(found)

    def state(self, checked: CheckedLayout) -> Pieces:
        return self._once(("state", *state_key(checked.layout)), lambda: state_pieces(checked.config))

    def step(self, checked: CheckedLayout) -> StepTransient:
        n_layers = checked.model_args.n_layers
        return self._once(("step", *state_key(checked.layout)), lambda: step_transient(checked.config, n_layers))

    def microbatch(self, checked: CheckedLayout) -> Pieces:
        size = checked.layout.microbatch_size
        return self._once(microbatch_key(checked.layout), lambda: microbatch_costs(checked.config, size))

    def _once(self, key: tuple, measure: Callable[[], T]) -> T:
        if key not in self._found:
            self._found[key] = measure()
        return self._found[key]


def state_key(layout: Layout) -> tuple[int, ...]:
    """What the model state's pieces and the optimizer step depend on (`torchpre.planner.stage_costs.state_config`):
    its sharding (dp, cp, tp, ep, ZeRO stage), not the pipeline (the probes' is two stages), activation
    checkpointing or the microbatch."""
    return layout.dp, layout.cp, layout.tp, layout.ep, layout.zero_stage


def microbatch_key(layout: Layout) -> tuple:
    """What a microbatch's costs depend on (`torchpre.planner.stage_costs.microbatch_config`): its sharding (tp, cp, ep;
    probed at dp = ep and ZeRO-1 over two stages), activation checkpointing and the microbatch size."""
    return "microbatch", layout.tp, layout.cp, layout.ep, layout.activation_checkpoint, layout.microbatch_size


def microbatch_costs(config: JobConfig, microbatch_size: int) -> Pieces:
    """Probed at 1 and 2 sequences and extended linearly beyond: activations and work per microbatch are
    affine in its size (every tensor but a few scalars scales with it; the op count does not change)."""
    if microbatch_size <= 2:
        return microbatch_pieces(config, microbatch_size)
    return affine(microbatch_pieces(config, 1), microbatch_pieces(config, 2), microbatch_size - 1)
