"""Two "nodes" on this machine: two torchrun agents meet through a c10d rendezvous, as multinode.slurm
launches them on a cluster, and train dp2; the losses equal those of one torchrun with --nproc-per-node 2."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launch import REPO, TINY, train_and_read_metrics

pytestmark = pytest.mark.slow

STEPS = 5
# Both runs have the same layout (dp2, one worker per rank, a gloo all-reduce over 2 ranks) and differ only in
# which agent started each worker, so their arithmetic is identical; 1e-6 leaves room for nothing but that.
LOSS_TOLERANCE = 1e-6
TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def torchrun_node(node: int, port: int, args: list[str], log: Path) -> subprocess.Popen:
    """One node's agent: node 0 hosts the rendezvous store at the endpoint (`is_host`), node 1 connects to it.

    Without `is_host` both agents would see that 127.0.0.1 is their own address and race to host the store.
    `--local-addr` is the address the workers of the node that gets rank 0 publish as MASTER_ADDR.
    """
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"test-{port}",
        "--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr", "127.0.0.1", "--max-restarts", "0",
        "train.py", *args,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with log.open("w") as output:
        # A session of its own, so a hang is ended by killing the agent and its workers together.
        return subprocess.Popen(
            command, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )


def wait_all(processes: list[subprocess.Popen], logs: list[Path], timeout_s: float) -> None:
    """Waits for every agent; a hang kills them all and fails with their logs."""
    deadline = time.monotonic() + timeout_s
    for process in processes:
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            for other in processes:
                if other.poll() is None:
                    os.killpg(other.pid, signal.SIGKILL)
            tails = "\n".join(f"--- {log.name}\n{log.read_text()[-2000:]}" for log in logs)
            pytest.fail(f"the two nodes did not finish within {timeout_s} s\n{tails}")
    for process, log in zip(processes, logs):
        assert process.returncode == 0, f"{log.name} failed:\n{log.read_text()[-3000:]}"


def test_two_nodes_train_exactly_like_one(tmp_path):
    data = tmp_path / "data.txt"
    data.write_text((REPO / "README.md").read_text(encoding="utf-8"))  # varied text, and quick to tokenize
    args = [*TINY, "--training.steps", str(STEPS), "--training.dataset", "text", "--training.dataset_path", str(data)]

    # Both nodes write to one dump folder, as they would to a shared file system; global rank 0 logs the metrics.
    multi = tmp_path / "multi"
    logs = [tmp_path / f"node{node}.log" for node in range(2)]
    port = free_port()
    nodes = [torchrun_node(node, port, [*args, "--job.dump_folder", str(multi)], logs[node]) for node in range(2)]
    wait_all(nodes, logs, TIMEOUT_S)
    two_nodes = [json.loads(line) for line in (multi / "metrics.jsonl").read_text().splitlines()]
    assert "layout dp 2 x tp 1 x pp 1" in "".join(log.read_text() for log in logs)

    one_node = train_and_read_metrics(args, 2, tmp_path / "single")
    assert [r["step"] for r in two_nodes] == list(range(1, STEPS + 1))
    losses = [r["loss"] for r in two_nodes]
    assert losses == pytest.approx([r["loss"] for r in one_node], abs=LOSS_TOLERANCE, rel=0)
    assert [r["grad_norm"] for r in two_nodes] == pytest.approx([r["grad_norm"] for r in one_node], rel=1e-6)
