"""Test-only: puts an inf into one module's output (forward) or into the gradient of that output (backward) at
one training step, in the step itself and in the step guard's forensic replay of it, and nowhere else.

Imported by the training processes through `--job.custom_import tests.nonfinite_injection`, so torchpre holds
no test code. `NONFINITE_INJECTION = "phase:module:step"` (e.g. "forward:layers.1:2") says what; the step is
read from the trainer as each `train_step` starts, and from the guard's replay, which names its step (which
runs in the next `train_step` when that step's verdict is read late).
"""

import os

import torch
from torch import nn

from torchpre.distributed.names import canonical_fqn
from torchpre.health.guard import StepGuard, TakenStep
from torchpre.training.trainer import Trainer

PHASE, MODULE, STEP = os.environ["NONFINITE_INJECTION"].split(":")
_current_step = 0
_original_train_step = Trainer.train_step
_original_locate = StepGuard._locate


def _with_inf(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.clone()
    tensor.view(-1)[0] = float("inf")
    return tensor


def _inject(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor | None:
    if _current_step != int(STEP):
        return None
    if PHASE == "forward":
        return _with_inf(output)
    output.register_hook(_with_inf)
    return None


def _install(trainer: Trainer) -> None:
    """A forward hook on the outermost module named MODULE, on the rank whose model parts hold it."""
    for part in trainer.job.model.parts:
        module = next((m for name, m in part.named_modules() if canonical_fqn(name) == MODULE), None)
        if module is not None:
            module.register_forward_hook(_inject)


def _train_step(self: Trainer, *args, **kwargs):
    global _current_step
    if _current_step == 0:
        _install(self)
    _current_step = self.step + 1
    return _original_train_step(self, *args, **kwargs)


def _locate(self: StepGuard, step: TakenStep, loop) -> str:
    global _current_step
    step_being_taken, _current_step = _current_step, step.number
    try:
        return _original_locate(self, step, loop)
    finally:
        _current_step = step_being_taken


Trainer.train_step = _train_step
StepGuard._locate = _locate
