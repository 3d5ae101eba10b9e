"""The optimizer step as the step guard applies it, followed by the model family's own per-step update."""

from collections.abc import Callable

import torch

from torchpre.optim.distributed_optimizer import DistributedOptimizer


class StepWithModelUpdate:
    """The optimizer as the step guard applies or discards its step (`torchpre.health.guard.StepOptimizer`), each
    followed by the model family's `ModelSpec.hooks.after_optimizer_step`, told whether the step was applied: training
    state that no optimizer owns (MoE's routing biases) then moves exactly when the parameters do, steps skipped on
    the device included, and a discarded step's statistics go with its gradients."""

    def __init__(self, optimizer: DistributedOptimizer, after_step: Callable[[torch.Tensor | float], None]) -> None:
        self.optimizer, self.after_step = optimizer, after_step

    @property
    def applies_conditionally(self) -> bool:
        return self.optimizer.applies_conditionally

    def apply(self, skip: torch.Tensor | None = None) -> None:
        self.optimizer.apply(skip)
        self.after_step(0.0 if skip is None else skip)

    def discard(self) -> None:
        self.optimizer.discard()
        self.after_step(1.0)
