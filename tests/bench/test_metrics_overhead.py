"""The metrics-overhead benchmark in quick mode: both costs are measured from real runs."""

import pytest

from bench.metrics_overhead import main

pytestmark = [pytest.mark.slow, pytest.mark.bench]


def test_quick_mode_measures_the_record_and_the_collective_timing(capsys):
    (row,) = main(["--quick"])
    assert row.layout == "dp2"
    assert 0 < row.record_s < row.step_s  # the record of a tiny model's step costs milliseconds, not a step
    assert 0 < row.record_share < 0.5
    assert row.untimed_step_s > 0 and -1 < row.timing_share < 1
    assert "| dp2 |" in capsys.readouterr().out
