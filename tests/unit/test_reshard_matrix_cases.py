"""The reshard matrix's generated cases and the sample CI runs of them."""

from tests.integration.test_reshard_matrix import SAMPLE, SAMPLE_SIZE
from tests.reshard_matrix import (
    COMMON,
    DEEPSEEK_V3_LAYOUTS,
    DTYPES,
    LAYOUTS,
    MODELS,
    OPTIMIZERS,
    axis_values,
    covering_sample,
    full_matrix,
)

PROBLEMS = {"1-tied-into-stages", "2-zero1-of-1d-tp-tensors", "4-dtype-change", "5-zero-bubble-bf16", "6-tp-ac-compile"}


def test_the_full_matrix_crosses_every_axis():
    cases = full_matrix()
    assert len({case.id for case in cases}) == len(cases)
    values = axis_values(cases)
    assert {v for axis, v in values if axis == "model"} == set(MODELS)
    assert {v for axis, v in values if axis == "dtype"} == set(DTYPES)
    assert {v for axis, v in values if axis == "optimizer"} == set(OPTIMIZERS)
    assert {v for axis, v in values if axis == "save"} == {v for axis, v in values if axis == "load"} == set(LAYOUTS)
    assert {v for axis, v in values if axis == "problem"} == PROBLEMS
    assert not [case for case in cases if case.model not in ("moe", "deepseek_v3") and "ep2" in case.save + case.load]


def test_deepseek_v3_crosses_every_dtype_and_pair_of_its_layouts_and_ci_runs_one_case():
    cases = [case for case in full_matrix() if case.model == "deepseek_v3"]
    pairs = {(case.save, case.load) for case in cases}
    assert pairs == {(save, load) for save in DEEPSEEK_V3_LAYOUTS for load in DEEPSEEK_V3_LAYOUTS if save != load}
    assert len(cases) == len(DTYPES) * len(pairs) == 48
    assert {"tp2-sp", "ep2"} <= set(DEEPSEEK_V3_LAYOUTS)  # latent down-projections replicated; experts split
    assert [case.id for case in SAMPLE if case.model == "deepseek_v3"] == ["deepseek_v3-bf16>fp32-dp2-zero1-to-ep2"]


def test_the_ci_sample_covers_every_axis_value_and_problem():
    assert len(SAMPLE) >= SAMPLE_SIZE >= 16
    assert axis_values(SAMPLE) == axis_values(full_matrix())
    assert SAMPLE == covering_sample(full_matrix(), SAMPLE_SIZE)  # deterministic: the same cases every run


def test_the_ci_sample_exercises_problems_5_and_6_for_real():
    """5: a run in bf16 on both sides (the tightest bf16 tolerance) steps under the zero-bubble V schedule with
    several pipeline microbatches a step, whose weight gradients accumulate over them. 6: tp2 + activation
    checkpointing + compile, in fp32 (the tight tolerance), in a case that catches no other problem, so no
    other problem's round trip failure stops it before the compiled training steps."""
    zero_bubble = [case for case in SAMPLE if case.dtype == "bf16" and "pp2-zbv" in (case.save, case.load)]
    assert zero_bubble
    microbatches = int(COMMON[COMMON.index("--training.local_batch_size") + 1])  # of 1 sequence, under PP
    assert microbatches >= 4  # the V schedule's 4 stages need at least 4
    compiled = [case for case in SAMPLE if case.problems() == {"6-tp-ac-compile"}]
    assert [(case.model[:5], case.dtype, case.ac, case.compile, "tp2" in case.load) for case in compiled] == [
        ("llama", "fp32", "full", True, True)
    ]
    assert [case for case in SAMPLE if case.compile] == compiled  # compiling costs ~20 s a graph: only there
