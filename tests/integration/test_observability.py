"""End to end: a non-finite step is skipped or stops the run as configured, phase timers add up to the
step time, and the profiler writes a trace per rank.

A learning rate of 1e30 makes the first update blow the weights up, so from step 2 on the gradients
are NaN on CPU, deterministically: no test hook in the trainer is needed to inject a failure.
"""

import json

import pytest
import torch

from tests.launch import TINY, run_train, train_and_read_metrics, train_and_read_params

pytestmark = pytest.mark.slow

# Constant lr (no warmup, no decay), so step 1 is the same whatever training.steps is.
EXPLODING = ["--optimizer.lr", "1e30", "--lr_scheduler.warmup_steps", "0", "--lr_scheduler.decay_ratio", "0"]


def test_skipped_steps_leave_the_parameters_bitwise_unchanged(tmp_path):
    _, after_one = train_and_read_params([*TINY, *EXPLODING, "--training.steps", "1"], 1, tmp_path / "one")
    records, after_three = train_and_read_params(
        [*TINY, *EXPLODING, "--training.steps", "3", "--training.on_nonfinite", "skip"], 1, tmp_path / "three"
    )
    assert [r["skipped_steps"] for r in records] == [0, 1, 2]
    assert after_one.keys() == after_three.keys()
    for name, value in after_one.items():
        assert torch.equal(value, after_three[name]), f"{name} changed in a skipped step"


def test_non_finite_step_stops_every_rank_after_saving_the_last_good_state(tmp_path):
    args = [*TINY, *EXPLODING, "--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "10"]
    result = run_train(args, 2, tmp_path)
    assert result.returncode != 0
    for rank in (0, 1):
        assert f"error (rank {rank}): step 2: the gradient norm is not finite" in result.stderr
    assert "The last good state (step 1) is saved" in result.stderr
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-1"]


def test_phase_timers_add_up_and_the_profiler_writes_a_trace_per_rank(tmp_path):
    args = [
        *TINY, "--training.steps", "4", "--metrics.log_freq", "2",
        "--checkpoint.enable", "--checkpoint.interval", "2",
        "--profiling.enable_profiling", "--profiling.profile_freq", "2",
    ]
    records = train_and_read_metrics(args, 2, tmp_path)
    for record in records:
        phases = [record[f"time/{name}_s"] for name in ("data", "forward_backward", "optimizer")]
        assert min(phases) >= 0 and 0 <= record["time/grad_comm_s"] <= record["time/optimizer_s"]
        assert sum(phases) <= record["step_time_s"] * 1.05 + 1e-3
        assert record["skipped_steps"] == 0 and record["loss_spikes"] == 0
    # Each record is written before its step's checkpoint (a crash after the save keeps the record), so the
    # step-2 save is timed on the step-4 record.
    assert "time/checkpoint_s" not in records[0] and records[1]["time/checkpoint_s"] > 0
    for step in (2, 4):
        for rank in (0, 1):
            trace = json.loads((tmp_path / "profile_traces" / f"step-{step}" / f"rank{rank}_trace.json").read_text())
            assert any(event.get("name", "").startswith("ProfilerStep") for event in trace["traceEvents"])
