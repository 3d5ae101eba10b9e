"""One dump folder, one run: resumes keep the global batch, a new run never mixes into an earlier run's
metrics, a finished job says so, and resuming from an earlier step sets the later checkpoints and records aside."""

import json
import shutil

import pytest

from tests.launch import TINY, run_train, train_and_read_metrics

pytestmark = pytest.mark.slow

CKPT = ["--checkpoint.enable", "--checkpoint.interval", "3"]
# Resharding changes only the reduction order (as in the parity tests), so their tolerance.
LOSS_ATOL = 1e-4


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def succeed(args: list[str], nproc: int, folder) -> str:
    result = run_train(args, nproc, folder)
    assert result.returncode == 0, f"training failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout + result.stderr


def test_resume_under_tp_keeps_the_derived_global_batch(tmp_path):
    """docs/checkpoints.md's example: trained on 2 processes as dp2 with global_batch_size = -1 (2 x 4 = 8 sequences),
    resumed under tp2 (dp1, where -1 alone would mean 4): the checkpoint's global batch is used, with 2
    accumulation steps, so the resumed losses are the uninterrupted ones."""
    args = [*TINY, *CKPT, "--training.steps", "6", "--training.global_batch_size", "-1"]
    straight = train_and_read_metrics(args, 2, tmp_path)
    shutil.rmtree(tmp_path / "checkpoint" / "step-6")
    (tmp_path / "metrics.jsonl").unlink()
    output = succeed([*args, "--parallelism.tensor_parallel_degree", "2"], 2, tmp_path)
    assert "global batch 8 from the checkpoint" in output
    assert "Warning" not in output  # reading the checkpoint's batch before the process group warns no more
    resumed = records(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [4, 5, 6]
    for got, want in zip(resumed, straight[3:]):
        assert got["loss"] == pytest.approx(want["loss"], abs=LOSS_ATOL)


def test_explicit_global_batch_change_is_logged(tmp_path):
    args = [*TINY, *CKPT, "--training.steps", "6"]
    succeed([*args, "--training.steps", "3"], 1, tmp_path)
    output = succeed([*args, "--training.global_batch_size", "8"], 1, tmp_path)
    assert "training.global_batch_size changes from 4 (the checkpoint's) to 8" in output


def test_new_run_in_a_used_dump_folder_starts_a_new_metrics_file(tmp_path):
    args = [*TINY, "--training.steps", "2"]
    succeed(args, 1, tmp_path)
    first = records(tmp_path / "metrics.jsonl")
    output = succeed([*args, "--training.steps", "3"], 1, tmp_path)
    assert f"job.dump_folder {tmp_path} already holds metrics of an earlier run" in output
    assert "moved them to metrics.1.jsonl;" in output
    assert records(tmp_path / "metrics.1.jsonl") == first
    assert [r["step"] for r in records(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_rerunning_a_finished_job_says_so_and_does_nothing(tmp_path):
    args = [*TINY, *CKPT, "--training.steps", "3"]
    succeed(args, 1, tmp_path)
    before = (tmp_path / "metrics.jsonl").read_text()
    output = succeed(args, 1, tmp_path)
    assert "already at step 3 = training.steps; nothing to do" in output
    assert "--training.steps" in output  # how to train further
    assert (tmp_path / "metrics.jsonl").read_text() == before


def test_load_step_before_a_later_checkpoint_sets_the_later_one_aside(tmp_path):
    """Resuming from step-3 while step-6 exists: step-6 moves to `superseded-from-step-3/` (kept, never
    overwritten, and no longer what a restart with load_step -1 would pick), and the records of steps 4-6 to
    `metrics.superseded-from-step-3.jsonl`; training then redoes 4-6, so metrics.jsonl holds each step once."""
    args = [*TINY, *CKPT, "--training.steps", "6"]
    straight = train_and_read_metrics(args, 1, tmp_path)
    old = (tmp_path / "checkpoint" / "step-6" / "manifest.json").read_text()
    output = succeed([*args, "--checkpoint.load_step", "3"], 1, tmp_path)
    aside = tmp_path / "checkpoint" / "superseded-from-step-3"
    assert f"moved step-6 to {aside}" in output
    assert (aside / "step-6" / "manifest.json").read_text() == old
    assert (tmp_path / "checkpoint" / "step-6").is_dir()
    later = tmp_path / "metrics.superseded-from-step-3.jsonl"
    assert f"moved the metrics records of the steps after it to {later}" in output
    assert records(later) == straight[3:]
    now = records(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in now] == [1, 2, 3, 4, 5, 6]
    assert now[:3] == straight[:3]
    assert [r["loss"] for r in now[3:]] == [r["loss"] for r in straight[3:]]


def test_a_run_prints_a_header_its_steps_and_a_summary_and_no_noise(tmp_path):
    """ZeRO-1 on 2 processes with the profiler on CPU: no deprecation or profiler warnings from any rank,
    the config in one line (the whole of it in config.toml), MFU at most 100%, and a closing summary."""
    args = [*TINY, "--training.steps", "3", "--optimizer.zero_stage", "1", "--profiling.enable_profiling",
            "--profiling.profile_freq", "2"]
    output = succeed(args, 2, tmp_path)
    for noise in ("Warning", "ERROR", "gpuGetDeviceCount", "USDT", "[training]"):
        assert noise not in output
    assert f"resolved config in {tmp_path / 'config.toml'}" in output
    assert "[training]" in (tmp_path / "config.toml").read_text()
    lines = output.strip().splitlines()
    assert len(lines) <= 10, output  # model line, config line, 3 steps, 2 traces, the summary
    assert " finished at step 3 of 3: 3 steps in " in lines[-1]
    assert f"metrics in {tmp_path / 'metrics.jsonl'}" in lines[-1]
    assert all(0 < r["mfu"] <= 1 for r in records(tmp_path / "metrics.jsonl"))
