"""Periodic torch.profiler traces of the training loop, and CUDA memory snapshots next to them, each written under a
new name and renamed into place, in a step folder that is no symbolic link (`torchpre.confined`)."""

import logging
import os
import warnings
from pathlib import Path
from types import TracebackType

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from torchpre.config.job_config import Profiling
from torchpre.confined import make_folder, replacing_path

logger = logging.getLogger("torchpre")

# Allocation events the CUDA memory history keeps (a ring buffer): enough for a few steps of a large model.
MEMORY_HISTORY_ENTRIES = 100_000


class Profiler:
    """Wraps the training loop (`with Profiler(...) as profiler:`); the loop calls `step()` after each step.

    Every `profile_freq` steps it records the last `profile_active` of them (after one untraced warm-up
    step when there is room, so the profiler's own start-up stays out of the trace) and writes
    `{folder}/step-N/rank{R}_trace.json` (Chrome trace format; N is the last step recorded). The
    schedule counts training steps, so a resumed run traces the same steps as an uninterrupted one.
    On CUDA the allocator's history is recorded throughout and dumped per trace as
    `rank{R}_memory_snapshot.pickle` (open it at https://pytorch.org/memory_viz). Disabled, it does nothing.
    """

    def __init__(self, config: Profiling, folder: Path, rank: int, device: torch.device, first_step: int) -> None:
        self.folder, self.rank, self.cuda = folder, rank, device.type == "cuda"
        self.step_number = first_step
        self._profile: profile | None = None
        if not config.enable_profiling:
            return
        if not self.cuda:
            # Kineto logs every start and stop, and on a CUDA build without a GPU an ERROR that it found no GPU:
            # noise on every rank for a CPU trace. Level 6 silences it; set KINETO_LOG_LEVEL to see it again.
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        warmup = 1 if config.profile_freq > config.profile_active else 0
        cycle = schedule(wait=config.profile_freq - config.profile_active - warmup, warmup=warmup,
                         active=config.profile_active)
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if self.cuda else [])]
        # The profiler numbers its steps from 0 at the start of this run; the offset makes them training steps.
        self._profile = profile(
            activities=activities, schedule=lambda k: cycle(first_step + k), on_trace_ready=self._save
        )

    def __enter__(self) -> "Profiler":
        if self._profile is not None:
            if self.cuda:
                torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
            self._profile.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self._profile is not None:
            self._profile.__exit__(exc_type, exc, traceback)
            if self.cuda:
                torch.cuda.memory._record_memory_history(enabled=None)

    def step(self) -> None:
        """Marks the end of a training step."""
        self.step_number += 1
        if self._profile is not None:
            with warnings.catch_warnings():  # "clears events at the end of each cycle": as intended, per trace
                warnings.filterwarnings("ignore", ".*Profiler clears events", UserWarning)
                self._profile.step()

    def _save(self, prof: profile) -> None:
        step_dir = make_folder(self.folder, f"step-{self.step_number}")
        with replacing_path(step_dir / f"rank{self.rank}_trace.json") as trace:
            prof.export_chrome_trace(str(trace))
        if self.cuda:
            with replacing_path(step_dir / f"rank{self.rank}_memory_snapshot.pickle") as snapshot:
                torch.cuda.memory._dump_snapshot(str(snapshot))
        logger.info("profiler trace of step %d written to %s", self.step_number, step_dir)
