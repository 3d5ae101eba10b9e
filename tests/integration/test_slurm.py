"""multinode.slurm under a real Slurm: a one-node cluster on this machine (scripts/slurm_local.sh: Debian's slurm-wlm,
munge, slurmctld and slurmd started by hand, two fake GPUs as GRES), jobs submitted with sbatch as a user submits
them. The fixture starts the cluster when none answers (as root) and stops it at the end if it started it.

    python -m pytest -q -p no:cacheprovider -m slurm tests/integration/test_slurm.py

A job requeued by `scontrol requeue` may start again only after about two minutes (Slurm sets its BeginTime); the
tests release it RELEASE_AFTER_S seconds after they see it pending, once per requeue. Not at once: slurmd refuses a
launch credential created in the same second as the one it revoked when the attempt ended (`cred->ctime <= revoked`,
whole seconds), and the job then FAILS ("Killing non-startable batch JobId=N: Job credential revoked" in
slurmctld.log) instead of running its next attempt; docs/multinode.md shows the run where it happened. The script
without Slurm: tests/unit/test_slurm_script.py.
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launch import REPO, TINY, train_and_read_metrics

pytestmark = pytest.mark.slurm

SLURM_DIR = Path(os.environ.get("SLURM_LOCAL_DIR", "/tmp/slurm-local"))
CONFIG = "train_configs/debug_model.toml"
STEPS = 160
# Every job trains the same run (2 ranks, dp2), so every job's losses are the uninterrupted job's, bit for bit: a
# resume restores the model, optimizer, data position and RNG exactly.
ARGS = [
    *TINY, "--training.steps", str(STEPS),
    "--checkpoint.enable", "--checkpoint.save_on_preemption", "--checkpoint.interval", "1000",
]  # fmt: skip
# Steps slowed (rank 1 sleeps, the other waits for it) so that a warning lands mid-run.
SLOW = ["--job.custom_import", "tests/slow_rank.py"]
JOB_TIMEOUT_S = 900
# A requeued job starts this long after it is seen pending: its new credential is then seconds younger than the
# revocation of the last one (see the docstring).
RELEASE_AFTER_S = 2


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Slurm:
    def __init__(self) -> None:
        self.env = {**os.environ, "SLURM_CONF": str(SLURM_DIR / "slurm.conf")}

    def run(self, *command: str) -> str:
        result = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, f"{' '.join(command)}: {result.stderr}"
        return result.stdout

    def up(self) -> bool:
        """Whether a node answers; False on a machine without Slurm's commands (the script installs them)."""
        if shutil.which("sinfo", path=self.env["PATH"]) is None:
            return False
        result = subprocess.run(["sinfo", "--noheader", "--states=idle,alloc,mix", "--format=%N"], env=self.env,
                                capture_output=True, text=True, timeout=60)  # fmt: skip
        return result.returncode == 0 and bool(result.stdout.strip())

    def submit(self, folder: Path, sbatch: list[str], args: list[str], **variables: str) -> "Job":
        """sbatch multinode.slurm from the repository, this interpreter's environment first on PATH (the job runs this
        checkout's torchpre), the output appended to folder/job.out, the dump folder folder/run."""
        env = {
            **self.env,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": str(REPO),
            "PYTHONUNBUFFERED": "1",
            "RDZV_PORT": str(free_port()),
            **variables,
        }
        command = [
            "sbatch", "--parsable", "--chdir", str(REPO), "--output", str(folder / "job.out"), *sbatch,
            "multinode.slurm", CONFIG, *args, "--job.dump_folder", str(folder / "run"),
        ]  # fmt: skip
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        return Job(self, result.stdout.strip().split(";")[0], folder)


class Job:
    def __init__(self, slurm: Slurm, job_id: str, folder: Path) -> None:
        self.slurm, self.id, self.folder = slurm, job_id, folder
        self.seen: list[tuple[str, int]] = []  # (state, restarts) as polled, repeats left out
        self.released: set[int] = set()  # the restart counts whose hold was shortened

    def info(self) -> dict[str, str]:
        line = self.slurm.run("scontrol", "show", "job", "--oneliner", self.id)
        return dict(field.split("=", 1) for field in line.split() if "=" in field)

    def poll(self) -> dict[str, str]:
        info = self.info()
        state, restarts = info["JobState"], int(info["Restarts"])
        if not self.seen or self.seen[-1] != (state, restarts):
            self.seen.append((state, restarts))
        if state == "PENDING" and info["Reason"] == "BeginTime" and restarts not in self.released:
            self.released.add(restarts)  # requeued: shorten Slurm's hold once (polled again, it would be pushed back)
            self.slurm.run("scontrol", "update", f"JobId={self.id}", f"StartTime=now+{RELEASE_AFTER_S}")
        return info

    def wait_until(self, done, what: str) -> None:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while not done(self.poll()):
            if time.monotonic() > deadline:
                self.slurm.run("scancel", self.id)
                tail = self.log()[-4000:]
                pytest.fail(f"job {self.id}: no {what} within {JOB_TIMEOUT_S} s; states {self.seen}\n{tail}")
            time.sleep(1)

    def finish(self) -> dict[str, str]:
        final = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
        self.wait_until(lambda info: info["JobState"] in final, "end")
        return self.info()

    def log(self) -> str:
        path = self.folder / "job.out"
        return path.read_text() if path.exists() else ""

    def records(self) -> list[dict]:
        path = self.folder / "run" / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def slurm():
    slurm = Slurm()
    started = False
    if not slurm.up():
        if os.geteuid() != 0:
            conf = slurm.env["SLURM_CONF"]
            pytest.fail(f"no Slurm answers at SLURM_CONF={conf}, and starting one needs root (scripts/slurm_local.sh)")
        subprocess.run([str(REPO / "scripts" / "slurm_local.sh"), "start"], check=True, timeout=900)
        started = True
    yield slurm
    if started:
        subprocess.run([str(REPO / "scripts" / "slurm_local.sh"), "stop"], check=True, timeout=60)


@pytest.fixture(scope="module")
def uninterrupted(slurm, tmp_path_factory) -> Job:
    """The run without interruption, on the two fake GPUs: one worker per GPU."""
    job = slurm.submit(tmp_path_factory.mktemp("uninterrupted"), ["--gpus-per-node", "2"], ARGS)
    job.finish()
    return job


def attempts(log: str) -> list[str]:
    """The attempt header lines of a job's output, in order."""
    return re.findall(r"^=== \S+ \S+ job \d+ attempt (\d+): \d+ nodes", log, flags=re.MULTILINE)


def assert_resumed_exactly(job: Job, uninterrupted: Job) -> list[int]:
    """The job ended COMPLETED after at least one requeue; each attempt but the last stopped after a step, saved it
    and was requeued, and the next resumed there; steps 1..STEPS are each logged once, with the uninterrupted job's
    losses and gradient norms bit for bit. Returns the steps the job stopped after."""
    info = job.info()
    log = job.log()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, log[-4000:])
    restarts = int(info["Restarts"])
    assert restarts >= 1 and ("PENDING", 1) in job.seen, job.seen  # requeued by the script, not resubmitted
    assert attempts(log) == [str(n) for n in range(1, restarts + 2)], log[-4000:]
    stops = [int(s) for s in re.findall(r"stopped after step (\d+) on Slurm's warning; saved, requeued", log)]
    assert len(stops) == restarts, log[-4000:]
    for step in stops:
        assert f"SIGUSR1 received: stopped after step {step} and saved" in log
        assert f"resuming at step {step}:" in log
    assert f"attempt {restarts + 1} ended with exit code 0" in log
    assert "Traceback" not in log and "DUE TO TIME LIMIT" not in log, log[-4000:]
    records, reference = job.records(), uninterrupted.records()
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [(r["loss"], r["grad_norm"]) for r in records] == [(r["loss"], r["grad_norm"]) for r in reference]
    return stops


def test_a_job_completes_with_the_losses_of_torchrun_on_one_machine(uninterrupted, tmp_path):
    info = uninterrupted.info()
    log = uninterrupted.log()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0" and info["Restarts"] == "0", (info, log)
    assert attempts(log) == ["1"]
    assert "1 nodes (" in log and "x 2 processes" in log  # SLURM_GPUS_ON_NODE=2
    assert "attempt 1 ended with exit code 0" in log
    records = uninterrupted.records()
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    args = ["--job.config_file", CONFIG, *ARGS]
    torchrun = train_and_read_metrics(args, 2, tmp_path / "torchrun", launcher="torchrun")
    assert [(r["loss"], r["grad_norm"]) for r in records] == [(r["loss"], r["grad_norm"]) for r in torchrun]


def test_the_warning_mid_run_saves_requeues_and_resumes_exactly(slurm, uninterrupted, tmp_path):
    """A CPU-only allocation with NPROC_PER_NODE=2; Slurm's warning (what --signal=B:USR1@... sends the batch shell
    before the time limit or at a preemption) sent by hand once 5 steps are logged."""
    job = slurm.submit(tmp_path, [], [*ARGS, *SLOW], NPROC_PER_NODE="2", SLOW_RANK_DELAY_S="0.2")
    job.wait_until(lambda info: len(job.records()) >= 5, "5 logged steps")
    slurm.run("scancel", "--signal=USR1", "--batch", job.id)
    job.finish()
    assert "x 2 processes" in job.log()
    assert assert_resumed_exactly(job, uninterrupted)[0] < STEPS


def test_a_time_limit_shorter_than_the_run_saves_requeues_and_resumes_exactly(slurm, uninterrupted, tmp_path):
    """Two minutes per attempt and the warning 30 s before (Slurm sends it up to 30 s earlier still), against a run
    of 160 steps of at least 0.5 s: no attempt can finish the run, so the warning ends at least the first."""
    job = slurm.submit(tmp_path, ["--time", "2", "--signal", "B:USR1@30"], [*ARGS, *SLOW], SLOW_RANK_DELAY_S="0.5")
    job.finish()
    assert job.info()["TimeLimit"] == "00:02:00"
    assert_resumed_exactly(job, uninterrupted)
