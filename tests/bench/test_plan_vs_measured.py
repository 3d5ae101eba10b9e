"""The planner's predictions against this machine's measurements (bench/plan_check.py), the issue's tolerances:
peak tensor memory within 10%, step time within 25%, once calibrated here (`torchpre.plan.calibrate`).

CI runs a sample of layouts that covers dp with ZeRO-1 and per-op AC, tp with sequence parallel, and a pipeline
with full AC; `-m plan_matrix` runs all eight (about 8 minutes on 2 cores)."""

import pytest

from bench.plan_check import LAYOUTS, MEMORY_TOLERANCE, TIME_TOLERANCE, compare
from torchpre.plan.calibrate import calibrate

pytestmark = pytest.mark.slow
CI_SAMPLE = ("dp2-zero1-ac-op", "tp2-sp", "pp2-gpipe-ac-full")


@pytest.fixture(scope="module")
def machine():
    """Measured right before the comparisons, on the same (possibly busy) machine."""
    return calibrate()


@pytest.mark.parametrize(
    "name", [name if name in CI_SAMPLE else pytest.param(name, marks=pytest.mark.plan_matrix) for name in LAYOUTS]
)
def test_prediction_matches_measurement(machine, name):
    row = compare(name, machine)
    assert abs(row.memory_error) <= MEMORY_TOLERANCE, row
    assert abs(row.time_error) <= TIME_TOLERANCE, row
