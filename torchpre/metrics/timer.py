"""Step timing that counts the device's queued work, not just the host's."""

import time

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
