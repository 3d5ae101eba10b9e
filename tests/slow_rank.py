"""`--job.custom_import tests/slow_rank.py`: rank 1 sleeps before each training step (`SLOW_RANK_DELAY_S` seconds,
default 1), a straggler for the tests (the delay is its own compute as far as the other ranks can tell: they wait
for it in the next collective), or a slow job."""

import os
import time

from torchpre.training.trainer import Trainer

DELAY_S = float(os.environ.get("SLOW_RANK_DELAY_S", "1.0"))

_train_step = Trainer.train_step


def _slow_train_step(self, *args, **kwargs):
    if int(os.environ["RANK"]) == 1:
        time.sleep(DELAY_S)
    return _train_step(self, *args, **kwargs)


Trainer.train_step = _slow_train_step
