"""The pipeline-bubble benchmark in quick mode: it measures real idle fractions and compares them with
the right theory."""

import pytest

from bench.pipeline_bubble import main, parse, run, theory

pytestmark = [pytest.mark.slow, pytest.mark.bench]


@pytest.fixture(scope="module")
def rows():
    """GPipe and 1F1B on the tiny model at m = 4, pp = 2 (two torchrun jobs)."""
    return run(parse(["--quick"]))


def test_quick_mode_measures_both_schedules_on_every_rank(rows):
    assert [(row.schedule, row.microbatches) for row in rows] == [("GPipe", 4), ("1F1B", 4)]
    for row in rows:
        assert len(row.idle_per_rank) == 2
        assert all(0 <= idle < 1 for idle in row.idle_per_rank)
        assert 0 <= row.idle < 1


def test_theory_is_the_fill_and_drain_fraction(rows):
    p, m = 2, 4
    for row in rows:
        assert row.theory == pytest.approx((p - 1) / (m + p - 1))  # 1/5
        assert row.difference == pytest.approx(row.idle - row.theory)


def test_gpipe_always_has_a_bubble(rows):
    gpipe = next(row for row in rows if row.schedule == "GPipe")
    # Fill and drain leave every rank idle for (p-1) of (m+p-1) slots; 0.05 is far below the 0.2 of theory.
    assert min(gpipe.idle_per_rank) > 0.05


def test_interleaved_and_zero_bubble_theory_shrink_the_bubble():
    assert theory("Interleaved1F1B", 2, 4) == pytest.approx(1 / 9)  # (p-1) / (v m + p-1), v = 2
    assert theory("ZBVZeroBubble", 2, 4) == pytest.approx(1 / 25)  # (p-1) / (6 m + p-1)
    assert theory("ZBVZeroBubble", 2, 4) < theory("Interleaved1F1B", 2, 4) < theory("1F1B", 2, 4)


def test_unknown_schedule_is_rejected_before_any_run(capsys):
    with pytest.raises(SystemExit):
        main(["--schedules", "GPipe,Pipedream"])
    assert "Pipedream" in capsys.readouterr().err
