"""The pipeline bubble and straggler metrics from known per-rank times, and when the straggler warning fires."""

import logging

import pytest

from torchpre.metrics.rank_times import StragglerWatch, pipeline_bubble_metrics, straggler_metrics


def test_the_bubble_is_each_rank_idle_share_of_the_longest_window():
    """1F1B at p = 2, m = 4 with unit slots: both ranks compute 4 of the 5 slots of the step; rank 1 ends a slot
    early, so its own window is 4 slots, but it is idle for the slot the schedule step still runs."""
    metrics = pipeline_bubble_metrics(busy=[4.0, 4.0], windows=[5.0, 4.0], theory=0.2)
    assert metrics == pytest.approx({"pipeline/bubble": 0.2, "pipeline/bubble_max": 0.2, "pipeline/bubble_theory": 0.2})
    uneven = pipeline_bubble_metrics(busy=[4.5, 3.0], windows=[5.0, 5.0], theory=0.2)
    assert uneven["pipeline/bubble"] == pytest.approx((0.1 + 0.4) / 2)
    assert uneven["pipeline/bubble_max"] == pytest.approx(0.4)


def test_the_straggler_is_the_busiest_rank_and_the_spread_is_relative_to_the_median():
    assert straggler_metrics([1.0, 1.0, 1.5, 1.0]) == pytest.approx(
        {"straggler/slowest_rank": 2, "straggler/spread": 0.5}
    )
    assert straggler_metrics([2.0, 2.0]) == {"straggler/slowest_rank": 0, "straggler/spread": 0.0}
    assert straggler_metrics([0.0, 0.0])["straggler/spread"] == 0.0


def test_the_warning_needs_window_intervals_in_a_row_then_repeats_every_window(caplog):
    watch = StragglerWatch(threshold=0.2, window=3, hosts=["node-a", "node-b"])
    slow, even = [1.0, 2.0], [1.0, 1.1]  # spreads 0.33 and 0.05
    caplog.set_level(logging.WARNING, logger="torchpre")
    warned_at = []
    for step, times in enumerate([slow, slow, even, slow, slow, slow, slow, slow, slow], start=1):
        caplog.clear()
        watch.observe(times, step)
        if caplog.records:
            warned_at.append(step)
            assert "rank 1 on host node-b" in caplog.text
    assert warned_at == [6, 9]  # the even interval at step 3 starts the count over
