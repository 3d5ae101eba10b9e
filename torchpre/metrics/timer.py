"""Step timing that counts the device's queued work, not just the host's."""

import time

import torch

from torchpre.distributed.clock import SpanClock


class PhaseTimer(SpanClock):
    """Time per named phase of a step (data, forward/backward, optimizer, ...), averaged over a log interval.

    Phases are `SpanClock` spans: on CUDA they measure the device's timeline, on which the phases of a step
    follow each other (a phase the GPU waits through, such as the host fetching data while the GPU is idle,
    counts as that phase). Phases may nest (`grad_comm` inside `optimizer`); each is reported on its own.
    """

    phase = SpanClock.span

    def averages(self, steps: int) -> dict[str, float]:
        """Seconds per step of each phase since the last call (one device sync on CUDA), then starts over."""
        return {name: total / steps for name, total in self.totals().items()}


class StepTimes:
    """Every step's duration over a log interval: their mean is `step_time_s`, their tail (`tail`) shows what a
    mean hides (a GC pause, a slow collective, a data stall).

    On CUDA each step boundary is an event and nothing is read until `durations()`: no host sync per step, and
    kernels still queued when the host reaches a log step are counted (the host runs ahead of the GPU). On CPU,
    perf_counter. `start()` opens an interval, `step()` closes each step in it.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._marks: list = []

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self._marks = [self._mark()]

    def step(self) -> None:
        self._marks.append(self._mark())

    def durations(self) -> list[float]:
        """Seconds of each step since `start()` (one device sync on CUDA)."""
        if not self.cuda:
            return [b - a for a, b in zip(self._marks, self._marks[1:])]
        self._marks[-1].synchronize()
        return [a.elapsed_time(b) / 1000 for a, b in zip(self._marks, self._marks[1:])]


TAIL_QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}


def tail(durations: list[float]) -> dict[str, float]:
    """`time/step_{p50,p90,p99,max}_s` of an interval's step durations; quantiles interpolate linearly between
    the sorted durations (numpy's default)."""
    ordered = sorted(durations)
    values = {name: _quantile(ordered, q) for name, q in TAIL_QUANTILES.items()} | {"max": ordered[-1]}
    return {f"time/step_{name}_s": value for name, value in values.items()}


def _quantile(ordered: list[float], q: float) -> float:
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
