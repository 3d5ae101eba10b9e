"""The pieces of elastic training that need no processes: which world sizes a layout can use, the one line a
resume under another layout logs, and the warning about torchrun's shared store. The end-to-end runs are in
tests/integration/test_elastic.py."""

import logging
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

from torchpre.checkpoint.layout import layout_change
from torchpre.distributed.elastic import usable_world_sizes, world_sizes_hint
from torchpre.distributed.process_groups import _restart_store

REPO = Path(__file__).resolve().parents[2]

DP2 = {"world_size": 2, "dp": 2, "tp": 1, "pp": 1, "ep": 1, "accumulation_steps": 1}
DP1 = {"world_size": 1, "dp": 1, "tp": 1, "pp": 1, "ep": 1, "accumulation_steps": 2}


def test_usable_world_sizes_are_the_fixed_degrees_times_every_dp_that_fits():
    assert usable_world_sizes(tp=2, pp=1) == [2, 4, 6, 8, 10, 12]
    assert usable_world_sizes(tp=2, pp=2, ep=2) == [8, 16, 24, 32, 40, 48]  # ep must divide dp
    assert usable_world_sizes(tp=2, pp=1, batch_rounds=2) == [2, 4]  # a global batch of 2 local batches: dp 1 or 2
    assert usable_world_sizes(tp=1, pp=1, ep=2, batch_rounds=12) == [2, 4, 6, 12]
    assert "2, 4." in world_sizes_hint(2, 1, batch_rounds=2)
    assert "run on: 1, 2, 3, 4, 6, 8, 12, 24. Under" in world_sizes_hint(1, 1, batch_rounds=24)
    # ep2 with a global batch of 3 local batches: no data-parallel degree is both even and a divisor of 3.
    assert world_sizes_hint(1, 1, ep=2, batch_rounds=3).startswith("No world size can run it")


def test_a_resume_under_the_saving_layout_logs_nothing():
    assert layout_change(DP2, DP2, Path("ckpt/step-4"), 4, 8) is None
    assert layout_change({}, DP1, Path("ckpt/step-4"), 4, 8) is None  # a checkpoint without a recorded layout


def test_a_changed_layout_is_one_line_with_both_layouts_the_reason_and_the_step(monkeypatch):
    for name in ("TORCHELASTIC_RUN_ID", "GROUP_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    line = layout_change(DP2, DP1, Path("ckpt/step-4"), 4, 8)
    assert line == (
        "layout changed: ckpt/step-4 was saved by 2 ranks as dp 2 x tp 1 x pp 1 (ep 1), 1 microbatch per step; "
        "this job runs 1 rank as dp 1 x tp 1 x pp 1 (ep 1), 2 microbatches per step (global batch 8), because the "
        "world size changed from 2 to 1. Resuming at step 4."
    )
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    line = layout_change(DP2, DP1, Path("ckpt/step-4"), 4, 8)
    assert "from 2 to 1 (torchrun's rendezvous round: 1 node, restart count 1; a node left or joined)." in line
    tp2 = {**DP2, "dp": 1, "tp": 2, "accumulation_steps": 2}
    assert "because the parallelism.* degrees changed on the same world size" in layout_change(
        DP2, tp2, Path("ckpt/step-4"), 4, 8
    )
    smaller_microbatches = {**DP2, "accumulation_steps": 2}
    assert "because training.local_batch_size or training.global_batch_size changed" in layout_change(
        DP2, smaller_microbatches, Path("ckpt/step-4"), 4, 8
    )
    legacy = layout_change({"world_size": 2}, DP1, Path("ckpt/step-4"), 4, 8)  # saved before the degrees were
    assert "was saved by 2 ranks (degrees not recorded); this job runs 1 rank as dp 1" in legacy


def test_a_restartable_multi_node_job_on_the_shared_store_is_warned_at_start(monkeypatch, caplog):
    """Its restart would stop with an error and a joining node would make the agents fail (docs/fault-tolerance.md,
    "Elastic training"): rank 0 says so before it happens."""
    timeout = timedelta(seconds=5)
    for name, value in (
        ("TORCHELASTIC_USE_AGENT_STORE", "True"), ("TORCHELASTIC_RESTART_COUNT", "0"), ("GROUP_WORLD_SIZE", "2"),
        ("TORCHELASTIC_MAX_RESTARTS", "3"), ("RANK", "0"),
    ):  # fmt: skip
        monkeypatch.setenv(name, value)
    with caplog.at_level(logging.WARNING, logger="torchpre"):
        assert _restart_store(timeout) is None
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in caplog.text
    caplog.clear()
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")  # never restarted: nothing to warn about
    with caplog.at_level(logging.WARNING, logger="torchpre"):
        _restart_store(timeout)
    assert not caplog.text


# A "worker" as torchrun starts train.py, and an "agent" that starts it, prints its pid and sleeps.
WORKER = "import time; from torchpre.distributed.elastic import die_with_agent; die_with_agent(); print('tied'); " + (
    "time.sleep(60)"
)
AGENT = """
import os, subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-u", "-c", sys.argv[1]], env={**os.environ, "TORCHELASTIC_RUN_ID": "t"},
                          stdout=subprocess.PIPE, text=True)
assert worker.stdout.readline().strip() == "tied"
print(worker.pid, flush=True)
time.sleep(60)
"""


def test_a_torchrun_worker_dies_with_its_agent():
    """What makes a killed agent a lost node instead of a node whose orphaned workers train on unseen
    (docs/fault-tolerance.md, "Elastic training", the exit barrier); end to end in
    test_shrink_under_tp2_continues_at_dp1_x_tp2_when_a_node_...
    """
    agent = subprocess.Popen([sys.executable, "-c", AGENT, WORKER], cwd=REPO, stdout=subprocess.PIPE, text=True)
    worker = 0
    try:
        worker = int(agent.stdout.readline())
        agent.kill()
        agent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while b"die_with_agent" in _cmdline(worker):
            assert time.monotonic() < deadline, "the worker outlived its agent"
            time.sleep(0.05)
    finally:
        agent.kill()
        if b"die_with_agent" in _cmdline(worker):  # still there: the test failed, leave nothing behind
            os.kill(worker, signal.SIGKILL)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # ended
        return b""
