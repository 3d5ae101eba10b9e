"""Faults, end to end under torchrun: a killed rank restarts and resumes exactly, a job killed after an async save
was written resumes from it, a full disk stops every rank with one paragraph and keeps the last checkpoint, SIGTERM
saves and stops at a step every rank agrees on, a hung peer fails within comm.timeout_seconds, and deterministic
reruns are bitwise equal. Plus the cheap pieces in-process: the SIGTERM handler and the new keys' checks."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from tests.launch import REPO, TINY, run_train
from torchpre.config.job_config import JobConfig
from torchpre.config.validate import validate_config
from torchpre.distributed.process_groups import _restart_store
from torchpre.errors import ConfigError, TorchpreError
from torchpre.runtime.cli import EXIT_COMM_FAILURE, EXIT_STORAGE_FAILURE, run_entry_point
from torchpre.runtime.preemption import PreemptionHandler

STEPS = 30
ARGS = [*TINY, "--training.steps", str(STEPS), "--training.deterministic"]
EVERY_2 = ["--checkpoint.enable", "--checkpoint.interval", "2"]
EVERY_5 = ["--checkpoint.enable", "--checkpoint.interval", "5"]
ONLY_LAST = ["--checkpoint.enable", "--checkpoint.interval", "1000"]
# fp32 on CPU and the same layout: a resumed run matches to 1e-6 (in practice exactly).
RESUME_ATOL = 1e-6


class Job:
    """A torchrun job in the background, its output in a file, that the test can signal and wait for."""

    def __init__(self, args: list[str], dump_folder: Path, *torchrun_args: str):
        self.dump_folder = dump_folder
        self.log = dump_folder.parent / f"{dump_folder.name}.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                [*command, *torchrun_args, "train.py", "--job.dump_folder", str(dump_folder), *args],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, so cleanup reaches the workers too
            )

    def output(self) -> str:
        return self.log.read_text()

    def wait_until(self, condition: Callable[[], bool], timeout: float = 120) -> None:
        """Polls `condition` while the job runs; fails if the job ends first or the time runs out."""
        deadline = time.monotonic() + timeout
        while not condition():
            if self.process.poll() is not None:
                pytest.fail(f"the job ended (exit {self.process.returncode}) too early:\n{self.output()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"waited {timeout} s in vain:\n{self.output()[-3000:]}")
            time.sleep(0.02)

    def wait(self, timeout: float = 180) -> int:
        return self.process.wait(timeout=timeout)

    def worker(self, rank: int) -> int:
        """The pid of the worker with this RANK: a child of torchrun whose environment says so."""
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
                environ = (stat.parent / "environ").read_bytes().split(b"\0")
            except (OSError, IndexError, ValueError):  # a process that ended while we looked
                continue
            if parent == self.process.pid and f"RANK={rank}".encode() in environ:
                return int(stat.parent.name)
        pytest.fail(f"no worker with RANK={rank} under torchrun {self.process.pid}")

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


@pytest.fixture
def jobs():
    """Starts jobs; whatever still runs at the end of the test is killed."""
    started: list[Job] = []

    def start(*args, **kwargs) -> Job:
        started.append(Job(*args, **kwargs))
        return started[-1]

    yield start
    for job in started:
        job.kill()


def records_by_step(dump_folder: Path) -> dict[int, dict]:
    """metrics.jsonl by step; a step logged again after a restart counts with its last record."""
    lines = (dump_folder / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record for record in map(json.loads, lines)}


def logged_steps(dump_folder: Path) -> int:
    path = dump_folder / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, dict]:
    """The uninterrupted run, with training.deterministic (checkpointing does not change the numbers)."""
    folder = tmp_path_factory.mktemp("reference")
    result = run_train(ARGS, 2, folder)
    assert result.returncode == 0, result.stderr[-3000:]
    return records_by_step(folder)


def assert_same_losses(records: dict[int, dict], reference: dict[int, dict], steps: range) -> None:
    assert sorted(records) == list(steps)
    for step in steps:
        assert records[step]["loss"] == pytest.approx(reference[step]["loss"], abs=RESUME_ATOL), f"step {step}"


# What `training.deterministic` promises, read back in a fresh interpreter (the settings are process-wide): the
# cuBLAS workspace variable set before CUDA starts, deterministic algorithms on, cuDNN autotuning off, and the
# Python, NumPy and torch generators seeded. Printed without the option, then with it.
DETERMINISM_PROBE = """
import json, os, random, sys
import numpy as np
import torch
from torchpre.runtime.determinism import configure_determinism

def settings():
    return {
        "cublas_workspace": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "cuda_initialized": torch.cuda.is_initialized(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
    }

def draws():
    return [random.random(), float(np.random.rand()), torch.rand(()).item()]

os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
configure_determinism(False, seed=7)
off = settings()
configure_determinism(True, seed=7)
on, seeded = settings(), draws()
random.seed(7); np.random.seed(7); torch.manual_seed(7)
print(json.dumps({"off": off, "on": on, "seeded": seeded == draws()}))
"""


def test_the_deterministic_option_sets_what_it_promises():
    """Two CPU runs agree bitwise with or without the option (CPU fp32 is deterministic), so the rerun test
    below cannot show that the option does anything: this checks the settings themselves."""
    env = {key: value for key, value in os.environ.items() if key != "CUBLAS_WORKSPACE_CONFIG"}
    result = subprocess.run(
        [sys.executable, "-c", DETERMINISM_PROBE], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    probe = json.loads(result.stdout.splitlines()[-1])
    assert probe["off"] == {
        "cublas_workspace": None, "cuda_initialized": False, "deterministic_algorithms": False,
        "cudnn_deterministic": False, "cudnn_benchmark": False,
    }
    assert probe["on"] == {
        "cublas_workspace": ":4096:8", "cuda_initialized": False, "deterministic_algorithms": True,
        "cudnn_deterministic": True, "cudnn_benchmark": False,
    }
    assert probe["seeded"], "configure_determinism did not seed random, numpy and torch from the seed"


@pytest.mark.slow
def test_deterministic_reruns_are_bitwise_equal(reference, tmp_path):
    """End to end: the same config on the same layout gives the same losses and norms, bit for bit."""
    result = run_train(ARGS, 2, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    rerun = records_by_step(tmp_path)
    assert [rerun[s]["loss"] for s in rerun] == [reference[s]["loss"] for s in reference]
    assert [rerun[s]["grad_norm"] for s in rerun] == [reference[s]["grad_norm"] for s in reference]


@pytest.mark.slow
def test_a_killed_rank_restarts_the_job_which_resumes_exactly(reference, jobs, tmp_path):
    job = jobs([*ARGS, *EVERY_2], tmp_path / "run", "--max-restarts", "1")
    job.wait_until(lambda: (tmp_path / "run" / "checkpoint" / "step-4").is_dir())
    os.kill(job.worker(rank=1), signal.SIGKILL)
    assert job.wait() == 0, job.output()[-3000:]
    assert "loaded " in job.output(), "the restarted workers did not resume from a checkpoint"
    assert_same_losses(records_by_step(tmp_path / "run"), reference, range(1, STEPS + 1))
    assert not list((tmp_path / "run" / "checkpoint").glob(".tmp-*"))


@pytest.mark.slow
@pytest.mark.parametrize("async_mode", ["async", "async_process"])
def test_a_job_killed_after_an_async_save_is_written_resumes_from_it(
    async_mode, reference, jobs, tmp_path, monkeypatch
):
    """Every process is killed after step-5's background write is done and before the next save (step 10): step-5
    must be published by then, not at the next save, and the rerun resumes from it exactly. Rank 0 holds the job
    at step 8 (tests/hold_at_step.py) until step-5 appears."""
    monkeypatch.setenv("HOLD_AT_STEP", "8")
    args = [*ARGS, *EVERY_5, "--checkpoint.async_mode", async_mode]
    job = jobs([*args, "--job.custom_import", "tests.hold_at_step"], tmp_path / "run")
    job.wait_until(lambda: (tmp_path / "run" / "held").exists())
    job.wait_until(lambda: (tmp_path / "run" / "checkpoint" / "step-5").is_dir(), timeout=60)
    job.kill()
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoint").iterdir()) == ["step-5"]
    result = run_train(args, 2, tmp_path / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"loaded {tmp_path / 'run' / 'checkpoint' / 'step-5'}" in result.stdout
    assert_same_losses(records_by_step(tmp_path / "run"), reference, range(1, STEPS + 1))


@pytest.fixture
def small_disk(tmp_path) -> Iterator[Path]:
    """A 7 MB tmpfs: room for one checkpoint of the tiny model (4.5 MB), not for two. Mounting it needs root; where
    it cannot be mounted the test is skipped (tests/unit/test_checkpoint_publication.py injects the same failures
    without a mount)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    command = ["mount", "-t", "tmpfs", "-o", "size=7m", "tmpfs", str(disk)]
    mount = subprocess.run(command, capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mount.stderr.strip()})")
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


@pytest.mark.slow
def test_a_save_on_a_full_disk_stops_every_rank_with_the_folder_and_sizes_and_keeps_the_last_checkpoint(
    small_disk, tmp_path
):
    """step-5 fits, step-10 does not: every rank exits with code 4 and one paragraph (no traceback) naming the folder,
    the bytes needed and free and what to do; no .tmp-step-* is left, and step-5, copied elsewhere, resumes to the
    losses the failed run logged for steps 6-10."""
    folder = small_disk / "checkpoint"
    args = [*TINY, "--training.steps", "10", *EVERY_5, "--checkpoint.folder", str(folder)]
    result = run_train(args, 2, tmp_path / "run")
    output = result.stdout + result.stderr
    assert result.returncode == EXIT_STORAGE_FAILURE, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert "the checkpoint of step 10 will not fit" in result.stdout  # the warning before the save
    lines = sorted(line for line in result.stderr.splitlines() if line.startswith("error (rank "))
    assert [line[:14] for line in lines] == ["error (rank 0)", "error (rank 1)"], result.stderr[-3000:]
    for line in lines:
        for fragment in (
            f"the checkpoint of step 10 could not be written to {folder}: no space left on the device",
            "[Errno 28] No space left on device", "bytes; the file system has", "bytes free", "free space there",
            f"resume from {folder / 'step-5'}",
        ):  # fmt: skip
            assert fragment in line, line
    assert sorted(p.name for p in folder.iterdir()) == ["step-5"]
    logged = records_by_step(tmp_path / "run")
    assert sorted(logged) == list(range(1, 11))  # the record of step 10 goes out before its save
    shutil.copytree(folder / "step-5", tmp_path / "resumed" / "checkpoint" / "step-5")
    result = run_train([*TINY, "--training.steps", "10", *EVERY_5], 2, tmp_path / "resumed")
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = records_by_step(tmp_path / "resumed")
    assert sorted(resumed) == list(range(6, 11))
    assert [resumed[step]["loss"] for step in resumed] == [logged[step]["loss"] for step in resumed]


@pytest.mark.slow
def test_an_async_save_that_fills_the_disk_stops_the_job_within_a_step(small_disk, tmp_path, monkeypatch):
    """Steps slowed to 0.4 s (tests/slow_rank.py), saves every 5: the background write of step-10 fails, and every
    rank stops after the step in progress when rank 0 logs the failure, with the same paragraph and exit code as a
    synchronous save, long before the next save (step 15) would have waited for it."""
    monkeypatch.setenv("SLOW_RANK_DELAY_S", "0.4")
    folder = small_disk / "checkpoint"
    args = [*TINY, "--training.steps", "20", *EVERY_5, "--checkpoint.folder", str(folder)]
    args += ["--checkpoint.async_mode", "async", "--job.custom_import", "tests.slow_rank"]
    result = run_train(args, 2, tmp_path / "run")
    assert result.returncode == EXIT_STORAGE_FAILURE, (result.stdout + result.stderr)[-3000:]
    assert "Traceback" not in result.stdout + result.stderr
    log = result.stdout.splitlines()
    failed_at = next(i for i, line in enumerate(log) if "the background save of step 10 failed" in line)
    steps_after = [line for line in log[failed_at:] if "| loss " in line]
    assert len(steps_after) <= 2, log[failed_at:]  # the step in progress (its record), and the stopping step
    assert max(records_by_step(tmp_path / "run")) < 15
    errors = [line for line in result.stderr.splitlines() if line.startswith("error (rank ")]
    assert len(errors) == 2 and all("could not be written to" in line for line in errors), result.stderr[-3000:]
    assert sorted(p.name for p in folder.iterdir()) == ["step-5"]


@pytest.mark.slow
def test_sigterm_saves_the_step_every_rank_stopped_at_and_resuming_continues_exactly(reference, jobs, tmp_path):
    """torchrun forwards SIGTERM to its workers, which stop after the same step, save it and exit 0; torchrun
    itself then exits 1 (it re-raises the signal as an exception)."""
    job = jobs([*ARGS, *ONLY_LAST, "--checkpoint.save_on_preemption"], tmp_path / "run")
    job.wait_until(lambda: logged_steps(tmp_path / "run") >= 3)
    job.process.send_signal(signal.SIGTERM)
    job.wait()
    stopped = max(records_by_step(tmp_path / "run"))
    assert stopped < STEPS
    assert f"SIGTERM received: stopped after step {stopped} and saved" in job.output()
    assert "exitcode" not in job.output(), "a worker failed"  # torchrun reports a worker's non-zero exit code
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoint").iterdir()) == [f"step-{stopped}"]
    result = run_train([*ARGS, *ONLY_LAST], 2, tmp_path / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_losses(records_by_step(tmp_path / "run"), reference, range(1, STEPS + 1))


@pytest.mark.slow
def test_a_stop_request_read_late_stops_every_rank_one_step_later_and_resumes_exactly(reference, tmp_path, monkeypatch):
    """With a fused optimizer and log steps apart, step 3's verdict (carrying rank 1's SIGTERM, received as step 2
    started) is read during step 4: every rank stops after step 4 and saves it, and tells a launcher that asked
    (TORCHPRE_STOP_FILE, as multinode.slurm does) the step it stopped after; the resumed run, which ends at its last
    step, tells it nothing."""
    monkeypatch.setenv("SIGTERM_AT_STEP", "2")
    stop_file = tmp_path / "stopped"
    monkeypatch.setenv("TORCHPRE_STOP_FILE", str(stop_file))
    read_late = [*ARGS, *ONLY_LAST, "--optimizer.implementation", "fused", "--metrics.log_freq", "100"]
    args = [*read_late, "--checkpoint.save_on_preemption", "--job.custom_import", "tests.sigterm_at_step"]
    result = run_train(args, 2, tmp_path / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    stopped = "SIGTERM or SIGUSR1 (by another rank) received: stopped after step 4 and saved"  # rank 0 did not get it
    assert stopped in result.stdout + result.stderr
    assert sorted(records_by_step(tmp_path / "run")) == [4]  # the stop step is logged
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoint").iterdir()) == ["step-4"]
    assert stop_file.read_text() == "4\n"
    stop_file.unlink()
    result = run_train([*read_late, "--metrics.log_freq", "1"], 2, tmp_path / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    assert not stop_file.exists()
    assert_same_losses(records_by_step(tmp_path / "run"), reference, range(4, STEPS + 1))


@pytest.mark.slow
def test_a_hung_peer_fails_the_job_within_comm_timeout(jobs, tmp_path):
    """After the first step the training timeout is in force, not the (here far longer) start-up one."""
    timeout = 10
    args = [*TINY, "--training.steps", "100000", "--comm.timeout_seconds", str(timeout)]
    args += ["--comm.init_timeout_seconds", "600"]
    job = jobs(args, tmp_path / "run")
    job.wait_until(lambda: logged_steps(tmp_path / "run") >= 2)
    hung = job.worker(rank=1)
    os.kill(hung, signal.SIGSTOP)
    start = time.monotonic()
    job.wait_until(lambda: "error (rank 0)" in job.output(), timeout=timeout + 30)
    assert time.monotonic() - start < timeout + 30
    # torchrun would SIGKILL the stopped worker after its 30 s shutdown timeout; resuming it lets its pending
    # SIGTERM end it now
    os.kill(hung, signal.SIGCONT)
    assert job.wait(timeout=60) != 0
    output = job.output()
    assert "error (rank 0): communication with the other ranks failed (Timed out waiting" in output, output[-3000:]
    assert f"comm.timeout_seconds = {timeout} s" in output
    # Rank 0 exited with the paragraph, not a traceback. (torchrun's summary may name the SIGTERMed rank 1 as
    # the root cause instead of rank 0's exit code 3, depending on which it reaps first.)
    assert "[rank0]: Traceback" not in output, output[-3000:]


def test_sigterm_sets_the_flag_only_while_the_handler_is_entered():
    before = signal.getsignal(signal.SIGTERM)
    with PreemptionHandler(enabled=True) as preemption:
        assert not preemption.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert preemption.requested
    assert signal.getsignal(signal.SIGTERM) is before
    with PreemptionHandler(enabled=False) as preemption:
        assert signal.getsignal(signal.SIGTERM) is before


def test_a_lost_peer_is_reported_as_one_paragraph_and_other_errors_propagate(capsys):
    def lost_peer(argv):
        raise RuntimeError("[third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms")

    with pytest.raises(SystemExit) as exit_info:
        run_entry_point(lost_peer, [], prog="train.py")
    assert exit_info.value.code == EXIT_COMM_FAILURE
    message = capsys.readouterr().err
    assert "communication with the other ranks failed (Timed out waiting 10000ms)" in message
    assert "comm.timeout_seconds" in message

    def bug(argv):
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        run_entry_point(bug, [], prog="train.py")


def test_only_a_restarted_attempt_on_a_shared_store_gets_its_own_keys(monkeypatch):
    """The single-node case runs in test_a_killed_rank_restarts_the_job_which_resumes_exactly; here the others."""
    timeout = timedelta(seconds=5)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert _restart_store(timeout) is None  # a first attempt: nothing stale to avoid
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    with pytest.raises(TorchpreError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        _restart_store(timeout)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # torchrun made a fresh store for this attempt
    assert _restart_store(timeout) is None


@pytest.mark.parametrize(
    "section, key, value, message",
    [
        ("checkpoint", "save_on_preemption", True, "checkpoint.enable is off"),
        ("comm", "timeout_seconds", 0.0, "comm.timeout_seconds = 0.0"),
        ("comm", "init_timeout_seconds", -1.0, "comm.init_timeout_seconds = -1.0"),
        ("comm", "timeout_seconds", float("inf"), "comm.timeout_seconds = inf"),
        ("comm", "trace_buf_size", -1, "comm.trace_buf_size = -1"),
        ("training", "gc_freq", -5, "training.gc_freq = -5"),
        ("metrics", "straggler_threshold", 0.0, "metrics.straggler_threshold = 0.0"),
        ("metrics", "straggler_window", 0, "metrics.straggler_window = 0"),
    ],
)
def test_new_keys_reject_impossible_values(section, key, value, message):
    config = JobConfig()
    setattr(getattr(config, section), key, value)
    with pytest.raises(ConfigError, match=message):
        validate_config(config)


@pytest.mark.slow
def test_a_damaged_checkpoint_skipped_on_resume_is_moved_aside_and_named_never_deleted(reference, tmp_path):
    """A byte of the latest checkpoint's data flips (a bad disk): `load_step = -1` resumes from the one before,
    moves the damaged folder to `damaged-step-N` with a warning naming it, and saving step N again leaves it intact
    (torchpre used to delete it silently when it published the new step N)."""
    result = run_train([*ARGS, *EVERY_5], 2, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoints = tmp_path / "checkpoint"
    data = next((checkpoints / "step-30").glob("*.distcp"))
    damaged = bytearray(data.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    data.write_bytes(bytes(damaged))
    resumed = run_train([*ARGS, *EVERY_5], 2, tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    log = resumed.stdout + resumed.stderr
    assert f"moved the damaged checkpoint step-30 aside to {checkpoints / 'damaged-step-30'}" in log
    assert (checkpoints / "damaged-step-30" / data.name).read_bytes() == bytes(damaged)
    kept = sorted(["damaged-step-30", *(f"step-{step}" for step in range(5, 31, 5))])
    assert sorted(p.name for p in checkpoints.iterdir()) == kept
    assert_same_losses(records_by_step(tmp_path), reference, range(1, STEPS + 1))
