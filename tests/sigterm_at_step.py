"""`--job.custom_import tests/sigterm_at_step.py`: rank 1 sends itself SIGTERM as training step `SIGTERM_AT_STEP`
(an environment variable) starts, so the stop request rides the all-reduce of the step after it, deterministically
(the trainer reads the handler's flag as each step starts)."""

import os
import signal

from torchpre.training.trainer import Trainer

_train_step = Trainer.train_step


def _train_step_then_signal(self, *args, **kwargs):
    if int(os.environ["RANK"]) == 1 and self.step + 1 == int(os.environ["SIGTERM_AT_STEP"]):
        os.kill(os.getpid(), signal.SIGTERM)
    return _train_step(self, *args, **kwargs)


Trainer.train_step = _train_step_then_signal
