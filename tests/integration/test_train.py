"""End-to-end training runs through train.py: the loss falls, and layouts agree with one process."""

import sys

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

from tests.launch import TINY, train_and_read_metrics

pytestmark = pytest.mark.slow

METRIC_KEYS = {
    "step", "loss", "lr", "grad_norm", "tokens_per_sec", "tokens_per_sec_per_device", "samples_per_sec", "mfu",
    "mfu_peak", "step_time_s", "data_time_s", "max_memory_bytes", "optimizer_state_bytes", "param_bytes", "grad_bytes",
    "time/step_p50_s", "time/step_p90_s", "time/step_p99_s", "time/step_max_s",
}

# fp32 on CPU: the only difference between layouts is the order of floating-point reductions
# (the gradient sum over ranks, the loss sum over microbatches), ~1e-7 relative per step; Adam
# amplifies it mildly over 10 steps. 1e-4 absolute on a loss of ~7 is far below any real bug
# (a wrong slice or a missing gradient term moves the loss by > 1e-2 within a few steps).
LOSS_TOLERANCE = 1e-4


def losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    """One process, global batch 8 in one microbatch, 10 steps."""
    folder = tmp_path_factory.mktemp("reference")
    return train_and_read_metrics([*TINY, "--training.local_batch_size", "8", "--training.steps", "10"], 1, folder)


def test_single_process_run_writes_metrics_and_the_resolved_config(reference, tmp_path):
    assert [r["step"] for r in reference] == list(range(1, 11))
    assert METRIC_KEYS <= reference[0].keys()
    first = reference[0]
    assert first["tokens_per_sec"] > 0 and 0 < first["mfu"] < 1
    assert first["optimizer_state_bytes"] > 0 and first["max_memory_bytes"] > 0
    for record in reference:
        assert record["samples_per_sec"] * 32 == pytest.approx(record["tokens_per_sec"])  # seq_len 32
        # log_freq 1: each interval is one step (an interval that does not start over holds earlier steps too), so
        # every percentile is that step's time, whose mean is step_time_s.
        tail = [record[f"time/step_{name}_s"] for name in ("p50", "p90", "p99", "max")]
        assert tail == pytest.approx([record["step_time_s"]] * 4)


def test_loss_decreases(tmp_path):
    args = [*TINY, "--training.seq_len", "64", "--training.local_batch_size", "8", "--training.steps", "40"]
    records = train_and_read_metrics([*args, "--optimizer.lr", "1e-2", "--lr_scheduler.warmup_steps", "5"], 1, tmp_path)
    first, last = losses(records[:3]), losses(records[-3:])
    assert min(first) > 7.5  # about ln(2048) = 7.6 at the start
    assert max(last) < min(first) - 1.0  # the tiny model reaches about 6.6 here
    config = tomllib.loads((tmp_path / "config.toml").read_text())
    assert config["training"]["steps"] == 40 and config["optimizer"]["lr"] == 1e-2


def test_dp2_matches_one_process(reference, tmp_path):
    records = train_and_read_metrics([*TINY, "--training.steps", "10"], 2, tmp_path)
    assert losses(records) == pytest.approx(losses(reference), abs=LOSS_TOLERANCE)
    grad_norms = [r["grad_norm"] for r in records]
    assert grad_norms == pytest.approx([r["grad_norm"] for r in reference], rel=1e-4)


def test_gradient_accumulation_matches_one_large_batch(reference, tmp_path):
    records = train_and_read_metrics(
        [*TINY, "--training.local_batch_size", "2", "--training.global_batch_size", "8", "--training.steps", "10"],
        1,
        tmp_path,
    )
    assert losses(records) == pytest.approx(losses(reference), abs=LOSS_TOLERANCE)


def test_dp2_with_accumulation_matches_one_process(reference, tmp_path):
    records = train_and_read_metrics(
        [*TINY, "--training.local_batch_size", "2", "--training.global_batch_size", "8", "--training.steps", "10"],
        2,
        tmp_path,
    )
    assert losses(records) == pytest.approx(losses(reference), abs=LOSS_TOLERANCE)
