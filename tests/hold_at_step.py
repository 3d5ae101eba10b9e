"""`--job.custom_import tests/hold_at_step.py`: rank 0 stops for good as training step `HOLD_AT_STEP` (an environment
variable) starts, after creating `{job.dump_folder}/held`, so that a test can kill the job at a known step (the other
ranks wait for rank 0 in that step's first collective; background threads and processes go on)."""

import os
import time
from pathlib import Path

from torchpre.training.trainer import Trainer

_train_step = Trainer.train_step


def _hold_or_train_step(self, *args, **kwargs):
    if int(os.environ["RANK"]) == 0 and self.step + 1 == int(os.environ["HOLD_AT_STEP"]):
        (Path(self.config.job.dump_folder) / "held").touch()
        time.sleep(3600)
    return _train_step(self, *args, **kwargs)


Trainer.train_step = _hold_or_train_step
