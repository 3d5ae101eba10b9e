"""Tail latency of training steps: the percentiles the trainer logs, from a known sequence of step times."""

import numpy as np
import pytest
import torch

from torchpre.metrics import timer as timer_module
from torchpre.metrics.timer import StepTimes, tail


def test_percentiles_of_a_known_sequence_of_step_times(monkeypatch):
    """Steps of 1, 2, ..., 9 s and one straggler of 30 s, timed in shuffled order: the median stays at 5.5 s while
    p99 and max show the straggler; linear interpolation between the sorted times, as numpy's default."""
    durations = [3.0, 1.0, 30.0, 2.0, 5.0, 4.0, 9.0, 6.0, 8.0, 7.0]
    clock = iter(np.cumsum([100.0, *durations]).tolist())
    monkeypatch.setattr(timer_module.time, "perf_counter", lambda: next(clock))
    times = StepTimes(torch.device("cpu"))
    times.start()
    for _ in durations:
        times.step()
    assert times.durations() == pytest.approx(durations)
    quantiles = {"p50": 50, "p90": 90, "p99": 99}
    expected = {f"time/step_{name}_s": np.percentile(durations, q) for name, q in quantiles.items()}
    measured = tail(times.durations())
    assert measured == pytest.approx(expected | {"time/step_max_s": 30.0})
    assert measured["time/step_p50_s"] == pytest.approx(5.5)
    assert measured["time/step_p90_s"] == pytest.approx(9.0 + 0.1 * 21.0)


def test_an_interval_starts_over():
    times = StepTimes(torch.device("cpu"))
    times.start()
    times.step()
    times.step()
    times.start()
    times.step()
    assert len(times.durations()) == 1
