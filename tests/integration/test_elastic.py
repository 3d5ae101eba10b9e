"""Elastic training on this machine: torchrun agents as "nodes" (`--nnodes 1:2`, c10d rendezvous on 127.0.0.1)
that leave (killed) or join a running job. torchrun re-forms the job, the workers resume the latest checkpoint with
dp absorbing the new world size and gradient accumulation keeping the global batch, and every step's loss (the last
record of each step in metrics.jsonl) equals that of an uninterrupted dp2 run."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.test_faults import records_by_step
from tests.launch import REPO, TINY, WORKER_ENV, run_train

pytestmark = pytest.mark.slow

STEPS = 12
# A fixed global batch of 8 sequences: 2 microbatches of 4 on one rank, 1 on each of two (dp1 and dp2 both split it).
ARGS = [*TINY, "--training.steps", str(STEPS), "--training.global_batch_size", "8"]
ELASTIC = ["--checkpoint.enable", "--checkpoint.interval", "4", "--checkpoint.save_on_preemption"]
# fp32 on CPU: dp1 x 2 microbatches and dp2 x 1 sum the same per-token losses in another order, which moves the
# loss by reduction-order rounding only (~1e-7 on a loss of ~8).
LOSS_TOLERANCE = 1e-5
# Under tp2 the matmuls themselves are split and reduced: rounding of the same size, on more operations.
TP_LOSS_TOLERANCE = 1e-5
TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (a torchrun agent's workers)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):  # a process that ended while we looked
            continue
    return found


def runs_training(pid: int) -> bool:
    """Whether `pid` is a training worker (train.py), not another child of the agent that comes and goes."""
    try:
        return b"train.py" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


class Node:
    """One torchrun agent of an elastic job (`--nnodes 1:2`) with its workers, output in a file.

    As docs/fault-tolerance.md's elastic example: `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` gives each rendezvous
    round a fresh worker store, `is_host` says which agent hosts the rendezvous store (both see that 127.0.0.1 is
    theirs), and `last_call_timeout=2` lets a round complete 2 s after its first node instead of torchrun's 30.
    """

    def __init__(
        self, name: str, port: int, nproc: int, args: list[str], folder: Path, host: bool, restarts: int,
        nnodes: str = "1:2",
    ):  # fmt: skip
        self.log = folder / f"{name}.log"
        self.run_id = f"elastic-{port}"
        command = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", nnodes, "--nproc-per-node", str(nproc), "--max-restarts", str(restarts),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", self.run_id,
            "--rdzv-conf", f"is_host={int(host)},last_call_timeout=2", "--local-addr", "127.0.0.1",
            "train.py", *args,
        ]  # fmt: skip
        env = {**os.environ, **WORKER_ENV, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "LOGLEVEL": "INFO"}
        with self.log.open("w") as output:
            self.process = subprocess.Popen(
                command, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.seen: set[int] = set()  # every worker seen, so that cleanup reaches orphans too

    def output(self) -> str:
        return self.log.read_text()

    def workers(self, count: int, timeout_s: float = 120) -> list[int]:
        """The pids of this agent's `count` workers, once they run."""
        deadline = time.monotonic() + timeout_s
        while len(pids := [pid for pid in children(self.process.pid) if runs_training(pid)]) < count:
            if time.monotonic() > deadline or self.process.poll() is not None:
                pytest.fail(f"{self.log.name}: no {count} workers:\n{self.output()[-3000:]}")
            time.sleep(0.05)
        self.seen.update(pids)
        return pids

    def wait(self, timeout_s: float = TIMEOUT_S) -> int:
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"{self.log.name} did not finish within {timeout_s} s:\n{self.output()[-3000:]}")

    def kill(self) -> None:
        """The whole node dies: its agent and its workers, each by pid (torchrun's workers have their own sessions)."""
        for pids in (self.seen, children(self.process.pid)):  # the known workers first, at once
            for pid in pids:
                if self.started(pid):
                    os.kill(pid, signal.SIGKILL)
        self.process.kill()
        self.process.wait(timeout=30)

    def started(self, pid: int) -> bool:
        """Whether `pid` is still a worker of this job (a pid that ended may since belong to another process)."""
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # ended
            return False
        return f"TORCHELASTIC_RUN_ID={self.run_id}".encode() in environ


@pytest.fixture
def nodes(tmp_path):
    """Starts nodes on one rendezvous port; whatever still runs at the end of the test is killed."""
    started: list[Node] = []
    port = free_port()

    def start(name: str, nproc: int, args: list[str], host: bool, restarts: int = 3, nnodes: str = "1:2") -> Node:
        started.append(Node(name, port, nproc, args, tmp_path, host, restarts, nnodes))
        return started[-1]

    yield start
    for node in started:
        node.kill()


def wait_for(condition: Callable[[], bool], what: str, logs: list[Node], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {node.log.name}\n{node.output()[-2000:]}" for node in logs)
            pytest.fail(f"waited {timeout_s} s for {what} in vain\n{tails}")
        time.sleep(0.02)


def assert_same_losses(run: Path, reference: dict[int, dict], tolerance: float) -> None:
    records = records_by_step(run)
    assert sorted(records) == list(range(1, STEPS + 1))
    for step in records:
        assert records[step]["loss"] == pytest.approx(reference[step]["loss"], abs=tolerance, rel=0), f"step {step}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, dict]:
    """The uninterrupted dp2 run (checkpointing does not change the numbers), shared by the tests."""
    folder = tmp_path_factory.mktemp("reference")
    result = run_train(ARGS, 2, folder)
    assert result.returncode == 0, result.stderr[-3000:]
    return records_by_step(folder)


def test_shrink_a_killed_node_leaves_the_job_to_the_other_which_finishes_with_the_same_losses(
    reference, nodes, tmp_path
):
    run = tmp_path / "run"
    args = [*ARGS, *ELASTIC, "--job.dump_folder", str(run)]
    host, other = nodes("node0", 1, args, host=True), nodes("node1", 1, args, host=False)
    other.workers(1)
    wait_for(lambda: (run / "checkpoint" / "step-4").is_dir(), "step-4", [host, other])
    other.kill()  # the node that does not host the rendezvous: the survivors need its store
    assert host.wait() == 0, host.output()[-3000:]

    assert_same_losses(run, reference, LOSS_TOLERANCE)
    output = host.output()
    assert "layout dp 1 x tp 1 x pp 1 (ep 1); global batch 8 = 2 microbatches of 4 per DP rank" in output
    assert "layout changed: " in output and "was saved by 2 ranks as dp 2 x tp 1 x pp 1 (ep 1), 1 microbatch" in output
    assert "this job runs 1 rank as dp 1 x tp 1 x pp 1 (ep 1), 2 microbatches per step" in output
    assert "the world size changed from 2 to 1 (torchrun's rendezvous round: 1 node, restart count 1" in output


def test_grow_a_joining_node_makes_the_job_dp2_after_a_save_and_the_losses_stay_the_same(reference, nodes, tmp_path):
    """The first node's worker is held (SIGSTOP) once step-4 exists, so that the job is still running when the
    second node has started; released once torchrun has seen the new node, it gets torchrun's SIGTERM, saves the
    step it is at (checkpoint.save_on_preemption) and the job continues from there at dp2."""
    run = tmp_path / "run"
    args = [*ARGS, *ELASTIC, "--job.dump_folder", str(run)]
    first = nodes("node0", 1, args, host=True)
    wait_for(lambda: (run / "checkpoint" / "step-4").is_dir(), "step-4", [first])
    [worker] = first.workers(1)
    os.kill(worker, signal.SIGSTOP)
    try:
        second = nodes("node1", 1, args, host=False)
        wait_for(lambda: "new nodes" in first.output(), "torchrun to see the second node", [first, second])
    finally:
        os.kill(worker, signal.SIGCONT)
    assert first.wait() == 0, first.output()[-3000:]
    assert second.wait() == 0, second.output()[-3000:]

    assert_same_losses(run, reference, LOSS_TOLERANCE)
    output = first.output() + second.output()
    saved = int(output.split("SIGTERM received: stopped after step ")[1].split()[0])
    assert 4 <= saved < STEPS
    assert f"loaded {run / 'checkpoint' / f'step-{saved}'}" in output  # nothing redone: it resumed the saved step
    assert "layout dp 2 x tp 1 x pp 1 (ep 1); global batch 8 = 1 microbatches of 4 per DP rank" in output
    assert "was saved by 1 rank as dp 1 x tp 1 x pp 1 (ep 1), 2 microbatches per step" in output
    assert "the world size changed from 1 to 2 (torchrun's rendezvous round: 2 nodes, restart count 0" in output


def test_shrink_under_tp2_continues_at_dp1_x_tp2_when_a_node_agent_dies(reference, nodes, tmp_path):
    """Four ranks as two nodes of two (dp2 x tp2). Only the second node's agent is killed: its workers die with it
    (torchpre ties them to it), so the first node restarts alone at dp1 x tp2 and its agent exits at once instead of
    waiting out torchrun's 300 s exit barrier for the dead node."""
    run = tmp_path / "run"
    args = [*ARGS, *ELASTIC, "--parallelism.tensor_parallel_degree", "2", "--job.dump_folder", str(run)]
    host, other = nodes("node0", 2, args, host=True), nodes("node1", 2, args, host=False)
    orphans = other.workers(2)
    wait_for(lambda: (run / "checkpoint" / "step-4").is_dir(), "step-4", [host, other])
    os.kill(other.process.pid, signal.SIGKILL)
    start = time.monotonic()
    assert host.wait() == 0, host.output()[-3000:]
    assert time.monotonic() - start < 120, "the surviving agent waited on torchrun's exit barrier"
    assert not [pid for pid in orphans if other.started(pid)], "workers outlived their agent"

    assert_same_losses(run, reference, TP_LOSS_TOLERANCE)
    output = host.output()
    assert "layout dp 1 x tp 2 x pp 1 (ep 1); global batch 8 = 2 microbatches of 4 per DP rank" in output
    assert "was saved by 4 ranks as dp 2 x tp 2 x pp 1 (ep 1), 1 microbatch per step" in output
    assert "this job runs 2 ranks as dp 1 x tp 2 x pp 1 (ep 1), 2 microbatches per step" in output


def test_a_world_size_the_layout_cannot_use_stops_with_the_sizes_that_work(nodes, tmp_path):
    """3 ranks under tp2: every worker stops before joining the process group (exit 2) naming the world sizes
    that fit, and the agent gives up (exit 1) well within the comm timeout. (With --max-restarts N each of the N
    restarts meets the same in as long again, ~20 s here for 3 workers, unless a node joined meanwhile.)"""
    timeout = 120
    args = [*ARGS, "--parallelism.tensor_parallel_degree", "2", "--comm.init_timeout_seconds", str(timeout)]
    node = nodes("node0", 3, [*args, "--job.dump_folder", str(tmp_path / "run")], host=True, restarts=0)
    start = time.monotonic()
    assert node.wait(timeout_s=timeout) != 0
    assert time.monotonic() - start < timeout
    output = node.output()
    assert "The world size 3 is not divisible by tensor_parallel_degree x pipeline_parallel_degree = 2 x 1" in output
    assert "World sizes this job can run on: 2, 4, 6, 8, 10, 12, ..." in output
    # A worker's exit code 2, in the agent's log line or its summary: once the first worker exits, torchrun
    # SIGTERMs the others (still in their wait for each other's message), and under load it may log one of those
    # first, so the summary's "exitcode  : 2" is where the 2 shows.
    assert re.search(r"exitcode\s*:\s*2\b", output), output[-4000:]
    assert sum(line.startswith("error (rank ") for line in output.splitlines()) == 3, output[-4000:]  # all say it


def test_a_world_size_that_cannot_split_the_global_batch_names_those_that_can(tmp_path):
    """3 ranks at dp 3 cannot split a global batch of 2 local batches: the same rule, for the batch."""
    result = run_train(ARGS, 3, tmp_path / "run")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "training.global_batch_size = 8 is not divisible by" in result.stderr
    assert "World sizes this job can run on: 1, 2. Under torchrun --nnodes MIN:MAX" in result.stderr
