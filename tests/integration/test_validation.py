"""Validation end to end through train.py: when it runs, that every layout reports the one-process
val_loss, and that it leaves training exactly as it would have been without it."""

import pytest

from tests.launch import TINY, run_train, train_and_read_metrics

pytestmark = pytest.mark.slow

# The tiny model, 4 steps of 4 sequences; an evaluation every 2 steps over 3 batches of 4 sequences.
BASE = [*TINY, "--training.steps", "4", "--validation.enable", "--validation.freq", "2", "--validation.steps", "3"]
NO_VALIDATION = [*TINY, "--training.steps", "4"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B"]
LAYOUTS = {
    "dp2": ["--training.local_batch_size", "2", "--validation.local_batch_size", "2"],
    "tp2_loss_parallel": ["--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_loss_parallel"],
    "pp2_1f1b": PP2,
    "cp2": ["--parallelism.context_parallel_degree", "2"],  # each rank evaluates half of every sequence
}
# fp32 on CPU: layouts differ only in reduction order (sharded matmuls, sums over ranks and pipeline
# microbatches), ~1e-7 relative; the training steps before an evaluation amplify it mildly. A wrong
# slice, a batch counted twice or a missing rank moves a loss of ~8 by far more than 1e-4.
VAL_LOSS_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def separate_data(tmp_path_factory) -> list[str]:
    """Validation text of its own, so that enabling validation leaves the training data as it was."""
    path = tmp_path_factory.mktemp("validation") / "validation.txt"
    path.write_text(
        " ".join(f"Sentence {i} of the validation text, which the model never trains on." for i in range(80))
    )
    return ["--validation.dataset", "text", "--validation.dataset_path", str(path)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Runs each (name, args, nproc) once per module and returns its records."""
    cache: dict[str, list[dict]] = {}

    def run(name: str, args: list[str], nproc: int = 1) -> list[dict]:
        if name not in cache:
            cache[name] = train_and_read_metrics(args, nproc, tmp_path_factory.mktemp(name))
        return cache[name]

    return run


def val_losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in records if "val_loss" in r}


def test_val_loss_is_logged_every_freq_steps_and_at_the_last_step(runs):
    """Held-out split of the training data (the default); validation steps are logged even off log_freq."""
    args = [*BASE, "--training.steps", "5", "--metrics.log_freq", "3"]
    records = runs("held_out", args)
    assert [r["step"] for r in records] == [2, 3, 4, 5]
    assert list(val_losses(records)) == [2, 4, 5]
    assert all(7.0 < loss < 9.0 for loss in val_losses(records).values())  # about ln(2048) = 7.6 untrained


def test_validation_has_no_side_effect_on_training(runs, separate_data):
    """RNG, data order and model state untouched: every training metric equal to the last bit."""
    with_validation = runs("one_process", [*BASE, *separate_data])
    without = runs("no_validation", NO_VALIDATION)
    assert list(val_losses(with_validation)) == [2, 4]
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in with_validation] == [r[key] for r in without], key


@pytest.mark.parametrize("layout", LAYOUTS)
def test_val_loss_matches_one_process(layout, runs, separate_data):
    reference = val_losses(runs("one_process", [*BASE, *separate_data]))
    records = runs(layout, [*BASE, *separate_data, *LAYOUTS[layout]], nproc=2)
    assert val_losses(records).keys() == reference.keys()
    for step, loss in val_losses(records).items():
        assert loss == pytest.approx(reference[step], abs=VAL_LOSS_TOLERANCE), step


def test_pipeline_evaluation_has_no_side_effect_on_training(runs, separate_data):
    """Switching the schedule to forward-only and back re-initialises its stages: training must not notice."""
    with_validation = runs("pp2_1f1b", [*BASE, *separate_data, *PP2], nproc=2)
    without = runs("pp2_no_validation", [*NO_VALIDATION, *PP2], nproc=2)
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in with_validation] == [r[key] for r in without], key


def test_bad_validation_config_stops_with_the_key(tmp_path):
    result = run_train([*BASE, "--validation.steps", "0"], 1, tmp_path, timeout=60)
    assert result.returncode != 0
    assert "validation.steps = 0" in result.stderr and "Traceback" not in result.stderr, result.stderr
