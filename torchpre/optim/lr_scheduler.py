"""Warmup-stable-decay learning-rate schedule."""

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from torchpre.config.job_config import LRScheduler


def wsd_factor(
    step: int, *, steps: int, warmup_steps: int, decay_ratio: float, decay_type: str, min_lr_factor: float
) -> float:
    """The lr multiplier for optimizer step `step` (0-based), in [min_lr_factor, 1].

    Linear warmup over `warmup_steps` (the first step already uses 1/(warmup_steps+1) of the lr, never
    0), then a constant lr, then a decay to `min_lr_factor` over the final `decay_ratio` fraction of
    the post-warmup steps, so `decay_ratio = 1` decays right after warmup and 0 never decays.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    decay_start = decay_start_step(steps=steps, warmup_steps=warmup_steps, decay_ratio=decay_ratio)
    decay_steps = steps - decay_start
    if step < decay_start or decay_steps == 0:
        return 1.0
    progress = min((step - decay_start + 1) / decay_steps, 1.0)  # past the last step (stepped after it): the floor
    if decay_type == "linear":
        remaining = 1 - progress
    elif decay_type == "sqrt":
        remaining = 1 - math.sqrt(progress)
    else:
        remaining = 0.5 * (1 + math.cos(math.pi * progress))
    return min_lr_factor + (1 - min_lr_factor) * remaining


def decay_start_step(*, steps: int, warmup_steps: int, decay_ratio: float) -> int:
    """The first (0-based) step of the decay: the last `decay_ratio` of the post-warmup steps decay (`steps` when
    none do). A data stage with start_at_decay starts here."""
    return steps - round(decay_ratio * (steps - warmup_steps))


class WarmupStableDecay(LambdaLR):
    """`LambdaLR` over `wsd_factor`, stepped once per optimizer step; its state_dict is the step count, and loading
    it also sets the optimizer's current lr (which a scheduler's state does not hold) from this job's schedule at that
    step: a resume that changes training.steps (or the schedule's keys) continues on the new schedule, not on the lr
    the saving job's schedule gave."""

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._last_lr = [base * factor(self.last_epoch) for base, factor in zip(self.base_lrs, self.lr_lambdas)]
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr


def build_lr_scheduler_from_config(optimizer: Optimizer, section: LRScheduler, steps: int) -> WarmupStableDecay:
    """`build_lr_scheduler` from the job's [lr_scheduler] section over `steps` (training.steps) optimizer steps."""
    return build_lr_scheduler(
        optimizer,
        steps=steps,
        warmup_steps=section.warmup_steps,
        decay_ratio=section.decay_ratio,
        decay_type=section.decay_type,
        min_lr_factor=section.min_lr_factor,
    )


def build_lr_scheduler(
    optimizer: Optimizer, *, steps: int, warmup_steps: int, decay_ratio: float, decay_type: str, min_lr_factor: float
) -> WarmupStableDecay:
    """The warmup-stable-decay schedule of `optimizer` (see `wsd_factor`)."""

    def factor(step: int) -> float:
        return wsd_factor(
            step,
            steps=steps,
            warmup_steps=warmup_steps,
            decay_ratio=decay_ratio,
            decay_type=decay_type,
            min_lr_factor=min_lr_factor,
        )

    return WarmupStableDecay(optimizer, factor)
