"""Step timing that counts the device's queued work, not just the host's."""

import contextlib
import time
from collections.abc import Iterator

import torch


class IntervalTimer:
    """Seconds since `start()`. On CUDA it times with events, so kernels still queued when the host
    reaches `elapsed()` are counted (the host runs ahead of the GPU); on CPU, perf_counter."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._start_time = 0.0
        self._start_event = torch.cuda.Event(enable_timing=True) if self.cuda else None

    def start(self) -> None:
        if self.cuda:
            self._start_event.record()
        else:
            self._start_time = time.perf_counter()

    def elapsed(self) -> float:
        if not self.cuda:
            return time.perf_counter() - self._start_time
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        return self._start_event.elapsed_time(end) / 1000


class PhaseTimer:
    """Time per named phase of a step (data, forward/backward, optimizer, ...), averaged over a log interval.

    On CUDA each phase is bracketed by two events on the current stream and nothing is read until
    `averages()`: timing adds no host sync per step, and the events measure the device's timeline, on
    which the phases of a step follow each other (a phase the GPU waits through, such as the host
    fetching data while the GPU is idle, counts as that phase). On CPU, perf_counter around each phase.
    Phases may nest (`grad_comm` inside `optimizer`); each is reported on its own.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._seconds: dict[str, float] = {}
        self._events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.setdefault(name, []).append((start, end))
            return
        began = time.perf_counter()
        yield
        self._seconds[name] = self._seconds.get(name, 0.0) + time.perf_counter() - began

    def averages(self, steps: int) -> dict[str, float]:
        """Seconds per step of each phase since the last call (one device sync on CUDA), then starts over."""
        seconds = dict(self._seconds)
        if self._events:
            torch.cuda.synchronize()
            for name, pairs in self._events.items():
                seconds[name] = sum(start.elapsed_time(end) for start, end in pairs) / 1000
        self._seconds, self._events = {}, {}
        return {name: total / steps for name, total in seconds.items()}


class StepTimes:
    """Every step's duration over a log interval, for its tail: `time/step_p50_s`, `p90`, `p99` and `max`.

    A straggling step (a GC pause, a slow collective, a data stall) hides in an interval's mean; its percentiles
    show it. On CUDA each boundary is an event and nothing is read until `percentiles()` (no host sync per step);
    on CPU, perf_counter. `start()` opens an interval, `step()` closes each step in it.
    """

    QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}

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

    def percentiles(self) -> dict[str, float]:
        """`time/step_{p50,p90,p99,max}_s` of the interval's steps; quantiles interpolate linearly between the
        sorted durations (numpy's default)."""
        durations = sorted(self.durations())
        values = {name: _quantile(durations, q) for name, q in self.QUANTILES.items()} | {"max": durations[-1]}
        return {f"time/step_{name}_s": value for name, value in values.items()}


def _quantile(ordered: list[float], q: float) -> float:
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
