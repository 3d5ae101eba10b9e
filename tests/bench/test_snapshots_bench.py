"""The in-memory snapshot benchmark in quick mode: the blocked time from paired runs, and both restarts measured."""

import pytest

from bench.snapshots import KILL_AFTER, main

pytestmark = [pytest.mark.slow, pytest.mark.bench]


def test_quick_mode_measures_the_blocked_time_and_both_restarts(capsys):
    result = main(["--quick"])
    step_off, step_on, blocked = (float(cell) for cell in result["blocked"][:3])
    assert step_off > 0 and step_on > 0 and 0 < blocked < step_on
    for source in ("snapshots", "disk"):
        [(seconds, restore_s, step)] = result[source]
        assert 0 < restore_s < seconds and KILL_AFTER - 1 <= step <= KILL_AFTER + 1
    assert "| snapshots |" in capsys.readouterr().out
