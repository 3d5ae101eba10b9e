"""End to end: a non-finite step is skipped or stops the run as configured, and its replay names where it
started; phase timers add up to the step time, and the profiler writes a trace per rank.

A learning rate of 1e30 makes the first update blow the weights up, so from step 2 on the gradients
are NaN on CPU, deterministically: no test hook in the trainer is needed to inject a failure. To put an inf
into one chosen module, tests/nonfinite_injection.py is imported through job.custom_import.
"""

import json
import math

import pytest
import torch

from tests.integration.test_checkpoint import _flatten
from tests.launch import TINY, read_checkpoint, run_train, train_and_read_metrics, train_and_read_params

pytestmark = pytest.mark.slow

# Constant lr (no warmup, no decay), so step 1 is the same whatever training.steps is.
EXPLODING = ["--optimizer.lr", "1e30", "--lr_scheduler.warmup_steps", "0", "--lr_scheduler.decay_ratio", "0"]
# As on CUDA: the update is applied conditionally on the device and the verdict of a step that is not logged,
# saved or the last is read during the next step.
READ_LATE = ["--optimizer.implementation", "fused", "--metrics.log_freq", "100"]


def test_skipped_steps_leave_the_parameters_bitwise_unchanged(tmp_path):
    _, after_one = train_and_read_params([*TINY, *EXPLODING, "--training.steps", "1"], 1, tmp_path / "one")
    records, after_three = train_and_read_params(
        [*TINY, *EXPLODING, "--training.steps", "3", "--training.on_nonfinite", "skip"], 1, tmp_path / "three"
    )
    assert [r["skipped_steps"] for r in records] == [0, 1, 2]
    assert after_one.keys() == after_three.keys()
    for name, value in after_one.items():
        assert torch.equal(value, after_three[name]), f"{name} changed in a skipped step"


def test_steps_skipped_on_the_device_and_read_late_leave_the_parameters_bitwise_unchanged(tmp_path):
    _, after_one = train_and_read_params(
        [*TINY, *EXPLODING, *READ_LATE, "--training.steps", "1"], 1, tmp_path / "one"
    )
    (record,), after_three = train_and_read_params(
        [*TINY, *EXPLODING, *READ_LATE, "--training.steps", "3", "--training.on_nonfinite", "skip"], 1,
        tmp_path / "three",
    )
    assert record["step"] == 3 and record["skipped_steps"] == 2  # step 2 read during step 3, step 3 at its end
    assert after_one.keys() == after_three.keys()
    for name, value in after_one.items():
        assert torch.equal(value, after_three[name]), f"{name} changed in a skipped step"


@pytest.mark.parametrize("read_late", [False, True], ids=["read-in-its-step", "read-during-the-next"])
def test_non_finite_step_stops_every_rank_after_saving_the_last_good_state(read_late: bool, tmp_path):
    """Read late, step 2's verdict arrives during step 3, whose gradients are then dropped; the host's step, data
    position and LR schedule go back to step 1, so the saved state is bitwise that of a run saved at step 1."""
    args = [*TINY, *EXPLODING, "--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "10"]
    args += READ_LATE if read_late else []
    result = run_train(args, 2, tmp_path)
    assert result.returncode != 0
    for rank in (0, 1):
        assert f"error (rank {rank}): step 2: the gradient norm is not finite" in result.stderr
    assert "The last good state (step 1) is saved" in result.stderr
    # The final norm's backward turns the gradient NaN (the forward stays finite at this learning rate).
    replay = (
        "Replaying the step, the forward stayed finite and the first non-finite value was the gradient of the output "
        "of layers.1 (backward; computed by the backward of what consumes that output) on rank 0, pipeline stage 0, "
        "microbatch 0 (global samples [8, 12))."
    )
    assert result.stderr.count(replay) == 2  # in each rank's error message
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-1"]
    if read_late:
        assert run_train([*args, "--training.steps", "1"], 2, tmp_path / "one").returncode == 0
        saved = _flatten(read_checkpoint(tmp_path / "checkpoint" / "step-1"))
        reference = _flatten(read_checkpoint(tmp_path / "one" / "checkpoint" / "step-1"))
        assert saved.keys() == reference.keys()
        for key, value in reference.items():
            same = torch.equal(value, saved[key]) if isinstance(value, torch.Tensor) else value == saved[key]
            assert same, f"{key}: saved {saved[key]}, a run saved at step 1 has {value}"


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
        assert not _nonfinite_keys(record)
    # Each record is written before its step's checkpoint (a crash after the save keeps the record), so the
    # step-2 save is timed on the step-4 record.
    assert "time/checkpoint_s" not in records[0] and records[1]["time/checkpoint_s"] > 0
    for step in (2, 4):
        for rank in (0, 1):
            trace = json.loads((tmp_path / "profile_traces" / f"step-{step}" / f"rank{rank}_trace.json").read_text())
            assert any(event.get("name", "").startswith("ProfilerStep") for event in trace["traceEvents"])


# NaN forensics: tests/nonfinite_injection.py puts an inf into one module's output (or into its gradient) at step 2
# of 3, in the step and in its replay only. Under pp2 the tiny model's layers.0 is on rank 0, layers.1 on rank 1;
# pipeline microbatches of one sequence, so microbatch 0 of step 2 is global sample 4.
INJECTED = [
    *TINY, "--parallelism.pipeline_parallel_degree", "2", "--job.custom_import", "tests.nonfinite_injection",
    "--training.steps", "3", "--training.on_nonfinite", "skip",
]


def _nonfinite_keys(record: dict) -> dict:
    return {key: value for key, value in record.items() if key.startswith("nonfinite/")}


def _train_injected(args: list[str], dump_folder) -> tuple[str, list[dict]]:
    result = run_train(args, 2, dump_folder)
    assert result.returncode == 0, f"training failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    records = [json.loads(line) for line in (dump_folder / "metrics.jsonl").read_text().splitlines()]
    return result.stdout + result.stderr, records


FINDING = {
    "nonfinite/step": 2, "nonfinite/first_module": "layers.1", "nonfinite/phase": "forward", "nonfinite/rank": 1,
    "nonfinite/stage": 1, "nonfinite/microbatch": 0,
}


def test_forensics_name_the_block_whose_output_went_inf_and_leave_training_as_it_was(tmp_path, monkeypatch):
    monkeypatch.setenv("NONFINITE_INJECTION", "forward:layers.1:2")
    log, records = _train_injected(INJECTED, tmp_path / "on")
    assert (
        "the update was skipped (1 skipped steps so far). Replaying the step, the first non-finite value was the "
        "output of layers.1 (forward) on rank 1, pipeline stage 1, microbatch 0 (global samples [4, 5))."
    ) in log
    assert [_nonfinite_keys(r) for r in records] == [{}, FINDING, {}]
    assert [r["skipped_steps"] for r in records] == [0, 1, 1]
    # The replay leaves no trace: the same job without it (the same arithmetic in the same order) has bitwise the
    # same losses and gradient norms at the other steps, and no nonfinite/* keys.
    _, without = _train_injected([*INJECTED, "--training.nonfinite_forensics", "0"], tmp_path / "off")
    assert [_nonfinite_keys(r) for r in without] == [{}, {}, {}]
    for record, reference in zip(records[::2], without[::2]):
        assert (record["loss"], record["grad_norm"]) == (reference["loss"], reference["grad_norm"])


def test_forensics_under_data_parallel_end_the_replays_gradient_reductions(tmp_path, monkeypatch):
    """Under dp2 the replay's backward starts bucket reductions (overlapped with it) that dropping its gradients must
    still finish; a replay that left them in flight changed the next steps' gradients. The other steps' losses and
    gradient norms stay bitwise those of the same job without the replay."""
    monkeypatch.setenv("NONFINITE_INJECTION", "forward:layers.1:2")
    data_parallel = [*INJECTED, "--parallelism.pipeline_parallel_degree", "1", "--training.steps", "4"]
    log, records = _train_injected(data_parallel, tmp_path / "on")
    assert "Replaying the step, the first non-finite value was the output of layers.1 (forward)" in log
    _, without = _train_injected([*data_parallel, "--training.nonfinite_forensics", "0"], tmp_path / "off")
    assert [r["skipped_steps"] for r in records] == [r["skipped_steps"] for r in without] == [0, 1, 1, 1]
    for record, reference in (pair for step, pair in enumerate(zip(records, without)) if step != 1):
        assert (record["loss"], record["grad_norm"]) == (reference["loss"], reference["grad_norm"])


def test_forensics_of_a_step_read_late_replay_it_on_its_own_state_and_leave_training_as_it_was(tmp_path, monkeypatch):
    """Step 2's verdict arrives during step 3: step 3's gradients are dropped, step 2 is replayed on the state
    before it (which the device kept: it skipped the update), step 3 is redone and carries the record."""
    monkeypatch.setenv("NONFINITE_INJECTION", "forward:layers.1:2")
    args = [*INJECTED, *READ_LATE, "--training.steps", "4"]
    log, records = _train_injected(args, tmp_path / "on")
    assert (
        "step 2: the loss and the gradient norm is not finite (loss nan, gradient norm nan) on global samples [4, 8); "
        "the update was skipped (1 skipped steps so far). Replaying the step, the first non-finite value was the "
        "output of layers.1 (forward) on rank 1, pipeline stage 1, microbatch 0 (global samples [4, 5))."
    ) in log
    assert [r["step"] for r in records] == [3, 4]
    assert [_nonfinite_keys(r) for r in records] == [FINDING, {}]
    _, without = _train_injected([*args, "--training.nonfinite_forensics", "0"], tmp_path / "off")
    assert [r["step"] for r in without] == [4] and without[0]["skipped_steps"] == 1
    assert (records[1]["loss"], records[1]["grad_norm"]) == (without[0]["loss"], without[0]["grad_norm"])


def test_forensics_name_the_backward_when_a_gradient_went_inf(tmp_path, monkeypatch):
    monkeypatch.setenv("NONFINITE_INJECTION", "backward:layers.0:2")
    log, records = _train_injected(INJECTED, tmp_path)
    assert (
        "Replaying the step, the forward stayed finite and the first non-finite value was the gradient of the output "
        "of layers.0 (backward; computed by the backward of what consumes that output) on rank 0, pipeline stage 0, "
        "microbatch 0 (global samples [4, 5))."
    ) in log
    assert math.isfinite(records[1]["loss"]) and math.isnan(records[1]["grad_norm"])
    assert _nonfinite_keys(records[1]) == {
        "nonfinite/step": 2, "nonfinite/first_module": "layers.0", "nonfinite/phase": "backward", "nonfinite/rank": 0,
        "nonfinite/stage": 0, "nonfinite/microbatch": 0,
    }
