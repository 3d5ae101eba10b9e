"""Time inside named spans of code, summed until read, without a host sync per span."""

import contextlib
import time
from collections.abc import Iterator

import torch


class SpanClock:
    """Seconds spent inside `span(name)` blocks per name, summed until `totals()` reads and resets them.

    On CUDA each span is bracketed by two events on the current stream and nothing is read until `totals()`:
    timing adds no host sync per span, and the events measure the device's timeline (a span the GPU waits
    through counts). On CPU, perf_counter. Spans of different names may nest (each counts on its own); a span
    inside an open span of the same name is already counted by the outer one and adds nothing, so wrapped
    calls that call each other are never counted twice.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._seconds: dict[str, float] = {}
        self._events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {}
        self._open: set[str] = set()

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        if name in self._open:
            yield
            return
        self._open.add(name)
        try:
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                try:
                    yield
                finally:
                    end.record()
                    self._events.setdefault(name, []).append((start, end))
            else:
                began = time.perf_counter()
                try:
                    yield
                finally:
                    self._seconds[name] = self._seconds.get(name, 0.0) + time.perf_counter() - began
        finally:
            self._open.discard(name)

    def totals(self) -> dict[str, float]:
        """Seconds per name since the last call (one device sync on CUDA), then starts over."""
        seconds = dict(self._seconds)
        if self._events:
            torch.cuda.synchronize()
            for name, pairs in self._events.items():
                seconds[name] = seconds.get(name, 0.0) + sum(start.elapsed_time(end) for start, end in pairs) / 1000
        self._seconds, self._events = {}, {}
        return seconds
