"""The planner against torchtitan's published H100 runs (issue 53), recomputed from the planner on every run: a later
change to the time or memory model that moves a row out of its band, or the rows out of their published order,
fails here instead of silently breaking the calibration (bench/plan_vs_published.py prints the same table)."""

import itertools

import pytest

from bench.plan_vs_published import HELD_OUT, compare_all
from torchpre.planner.predict import ERROR_BARS

pytest.importorskip("torchao")  # the Float8 rows' linears

# The errors the model gives today (docs/planning.md#checked-against-published-runs), pinned: a change that moves a
# row's TPS error by more than 3 points, or its memory error by more than 2, must say so here and in the docs.
PINNED_TPS_ERROR = (-0.036, 0.025, -0.023, -0.070, -0.154, 0.111, 0.147, -0.006, 0.053, -0.000)
PINNED_MEMORY_ERROR = (0.007, 0.008, 0.011, 0.004, 0.000, 0.003, -0.003, -0.006, -0.013, -0.010)


@pytest.fixture(scope="module")
def compared():
    return compare_all("h100-96gb-hbm2e-500w")


def test_every_row_is_within_its_band(compared):
    """Reserved memory within ±10% and TPS/GPU within ±20% of what torchtitan published, on every row."""
    outside = [(c.row.name, f"memory {c.memory_error:+.1%}", f"TPS {c.tps_error:+.1%}") for c in compared
               if abs(c.memory_error) > ERROR_BARS["memory_gib"]
               or abs(c.tps_error) > ERROR_BARS["tokens_per_s_per_gpu"]]  # fmt: skip
    assert not outside


def test_the_errors_are_the_documented_ones(compared):
    assert [c.tps_error for c in compared] == pytest.approx(PINNED_TPS_ERROR, abs=0.03)
    assert [c.memory_error for c in compared] == pytest.approx(PINNED_MEMORY_ERROR, abs=0.02)


def test_rows_further_apart_than_the_error_come_out_in_the_published_order(compared):
    """Where two published TPS/GPU differ by more than the stated error (20%), the predictions rank them the same."""
    for a, b in itertools.combinations(compared, 2):
        if max(a.row.tps_per_gpu, b.row.tps_per_gpu) > 1.2 * min(a.row.tps_per_gpu, b.row.tps_per_gpu):
            assert (a.row.tps_per_gpu > b.row.tps_per_gpu) == (a.tps_per_gpu > b.tps_per_gpu), (a.row.name, b.row.name)


def test_the_tensor_peak_is_below_the_reserved_one(compared):
    """The dry run counts tensors; the allocator reserves more (docs: the gap, modelled explicitly)."""
    for c in compared:
        assert c.tensor_gib < c.reserved_gib < 1.2 * c.tensor_gib


# torchtitan's 70B and 405B rows (tables 4-6), which nothing in the model was fitted to: today's errors, pinned as the
# 8B rows' are. Before the unsharded gradients of ZeRO-3 under pipelining were counted, every 405B row's memory was
# 19-35% low (docs/planning.md#rows-the-model-was-not-fitted-on).
HELD_OUT_TPS_ERROR = (-0.132, -0.077, 0.084, -0.110, 0.039, 0.015, 0.149)
# The interleaved row was 14.0% over while the planner held the largest chunk's bytes (on the last rank, the output
# layer's) for every microbatch in flight; the walk of the schedule's actions holds the last stage once.
HELD_OUT_MEMORY_ERROR = (-0.043, -0.040, 0.024, 0.086, 0.080, 0.063, -0.033)


@pytest.fixture(scope="module")
def held_out():
    return compare_all("h100-96gb-hbm2e-500w", rows=HELD_OUT)


def test_the_rows_nothing_was_fitted_to_are_within_the_bands(held_out):
    """70B at FSDP 32 x TP 8, 405B at FSDP x TP 8 x PP 8 under 1F1B and Interleaved 1F1B, with cp 1-8: TPS/GPU
    within ±20% and memory within ±10% on every row."""
    assert all(abs(c.tps_error) <= ERROR_BARS["tokens_per_s_per_gpu"] for c in held_out), held_out
    assert all(abs(c.memory_error) <= ERROR_BARS["memory_gib"] for c in held_out), held_out


def test_the_held_out_errors_are_the_documented_ones(held_out):
    assert [c.tps_error for c in held_out] == pytest.approx(HELD_OUT_TPS_ERROR, abs=0.03)
    assert [c.memory_error for c in held_out] == pytest.approx(HELD_OUT_MEMORY_ERROR, abs=0.02)
