"""A torchrun worker that failed waits for its peers to settle before it exits (torchpre.distributed.peer_exit), so
that torchrun does not stop a slower rank before it prints its own message: played here with a real TCPStore as
torchrun's agent store and the other rank as a thread, its delays far longer than a poll, far shorter than a bound.
The real torchrun launches are in tests/integration/test_bad_input.py (`test_every_torchrun_worker_exits_...`)."""

import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from torchpre.distributed import peer_exit

DELAY_S = 1.0  # the other rank's lag: the waits must end with it (within 10 s, under load), far before their bounds


@pytest.fixture
def agent_store(monkeypatch) -> Iterator[dist.TCPStore]:
    """A store served as torchrun's agent serves it, and rank 0's environment of a 2-rank job."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
           "WORLD_SIZE": "2", "RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0"}  # fmt: skip
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    yield store


def later(action: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(DELAY_S), action()))
    thread.start()
    return thread


def timed_wait(joined: bool) -> float:
    start = time.monotonic()
    peer_exit.wait_for_failed_peers(joined=joined)
    return time.monotonic() - start


@pytest.mark.parametrize("peer", ["fails", "passes the checks"])
def test_a_failure_before_the_process_group_waits_until_the_peer_fails_or_joins(agent_store, monkeypatch, peer):
    """However long the peer takes to decide (the bound, 600 s, is 30 s here), the wait ends when it has: no sooner,
    no later."""
    monkeypatch.setattr(peer_exit, "PRE_JOIN_WAIT_S", 30.0)
    key = "torchpre/failed_before_joining/0" if peer == "fails" else "torchpre/joined/0"
    thread = later(lambda: agent_store.add(key, 1))
    waited = timed_wait(joined=False)
    thread.join()
    assert DELAY_S <= waited < DELAY_S + 10


def test_a_failure_after_the_process_group_waits_for_the_peers_failure_or_its_bound(agent_store, monkeypatch):
    """The peer has joined (counted before the group): only its own failure, or the bound, ends the wait."""
    agent_store.add("torchpre/joined/0", 2)
    thread = later(lambda: agent_store.add("torchpre/failed_after_joining/0", 1))
    assert DELAY_S <= timed_wait(joined=True) < DELAY_S + 10
    thread.join()
    monkeypatch.setattr(peer_exit, "POST_JOIN_WAIT_S", DELAY_S)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a restarted job counts anew: its peer has not failed
    assert DELAY_S <= timed_wait(joined=True) < DELAY_S + 10


def test_joining_counts_the_rank_in_the_agent_store(agent_store):
    peer_exit.count_joined()
    assert agent_store.add("torchpre/joined/0", 0) == 1
