"""The reshard matrix's generated cases and the sample CI runs of them."""

from tests.integration.test_reshard_matrix import SAMPLE, SAMPLE_SIZE
from tests.reshard_matrix import DTYPES, LAYOUTS, MODELS, axis_values, covering_sample, full_matrix

PROBLEMS = {"1-tied-into-stages", "2-zero1-of-1d-tp-tensors", "4-dtype-change", "5-zero-bubble-bf16", "6-tp-ac-compile"}


def test_the_full_matrix_crosses_every_axis():
    cases = full_matrix()
    assert len({case.id for case in cases}) == len(cases)
    values = axis_values(cases)
    assert {v for axis, v in values if axis == "model"} == set(MODELS)
    assert {v for axis, v in values if axis == "dtype"} == set(DTYPES)
    assert {v for axis, v in values if axis == "save"} == {v for axis, v in values if axis == "load"} == set(LAYOUTS)
    assert {v for axis, v in values if axis == "problem"} == PROBLEMS
    assert not [case for case in cases if case.model != "moe" and "ep2" in case.save + case.load]


def test_the_ci_sample_covers_every_axis_value_and_problem():
    assert len(SAMPLE) >= SAMPLE_SIZE >= 16
    assert axis_values(SAMPLE) == axis_values(full_matrix())
    assert SAMPLE == covering_sample(full_matrix(), SAMPLE_SIZE)  # deterministic: the same cases every run
