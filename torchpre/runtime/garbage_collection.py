"""Python's garbage collector under the trainer's control: every rank collects at the same steps.

An automatic collection starts whenever one process's allocation counters say so, at a different moment on each
rank; the rank that collects arrives late at the next collective and every peer waits for it. With N ranks a
step is as slow as its slowest rank, so at scale some rank pauses nearly every step. Collecting on a fixed
schedule of steps makes all ranks pause together, once (torchtitan's `GarbageCollection` does the same).
"""

import gc
import logging
import time
from types import TracebackType

logger = logging.getLogger("torchpre")


class GarbageCollection:
    """Within `with`, automatic collection is off and `step(n)` collects generation 1 when n is a multiple of
    `freq` (steps are global, so every rank collects at the same step); leaving restores the collector as it was.
    `freq` 0 changes nothing."""

    def __init__(self, freq: int):
        self.freq = freq
        self._was_enabled = False

    def __enter__(self) -> "GarbageCollection":
        if self.freq > 0:
            self._was_enabled = gc.isenabled()
            gc.disable()
            collect(generation=1)  # start-up's garbage goes now, not into the first interval
        return self

    def step(self, step: int) -> None:
        """Called after optimizer step `step` (1, 2, ...) on every rank."""
        if self.freq > 0 and step % self.freq == 0:
            collect(generation=1)

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self.freq > 0 and self._was_enabled:
            gc.enable()


def collect(generation: int) -> None:
    """Collects `generation` and the younger ones, logging the pause at debug level."""
    start = time.perf_counter()
    gc.collect(generation)
    logger.debug("garbage collection (generation %d): %.3f s", generation, time.perf_counter() - start)
