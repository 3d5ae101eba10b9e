"""Every rank of a torchrun job prints its own bad-input message before torchrun stops them.

torchrun stops every worker as soon as one exits with an error. Bad input is checked identically on every rank, so
they all fail, but not at the same moment: on a loaded machine one rank can reach the check tens of seconds after
another (measured: a rank SIGTERMed before printing, at a load of 14 on 2 cores, with a fixed 20 s wait). So a rank
that failed counts itself in the store of torchrun's agent and waits until every rank has settled:
- before the process group: each rank either fails its checks or, having passed them, counts itself as joining
  (`count_joined`, just before it joins), so the wait ends as soon as every rank did one or the other, however
  slow, with PRE_JOIN_WAIT_S as a bound for a rank stuck before it decides;
- after it: the ranks came out of the group's rendezvous together and fail on the same input a moment apart, so
  the wait ends when every rank has failed, or after POST_JOIN_WAIT_S (a failure of this rank's own, whose peers
  wait in a collective until torchrun stops them).
Without torchrun's agent store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, where rank 0 serves the store only once
the group exists) nothing is counted before the group, and a failure there waits a few seconds.
"""

import os
import time
from datetime import timedelta

import torch.distributed as dist

PRE_JOIN_WAIT_S = 600.0
POST_JOIN_WAIT_S = 60.0
_NO_STORE_WAIT_S = 3.0
_CONNECT_S = 30.0
_POLL_S = 0.05


def _agent_store(joined: bool = False) -> dist.Store | None:
    """The store of this worker's torchrun job; None outside torchrun, or before the process group where the agent
    serves none (rank 0's process serves it once the group is up)."""
    if "MASTER_ADDR" not in os.environ or not (joined or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"):
        return None
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=_CONNECT_S))


def _key(name: str) -> str:
    """A key of this attempt's workers (a restarted job's workers count anew)."""
    return f"torchpre/{name}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def count_joined() -> None:
    """Counts this rank as past the checks that run before the process group (call it just before joining)."""
    try:
        store = _agent_store()
        if store is not None:
            store.add(_key("joined"), 1)
    except Exception:  # a courtesy count: whatever keeps it from the store, a failing peer then waits its bound
        return


def wait_for_failed_peers(joined: bool) -> None:
    """Counts this rank's failure and waits until every rank has settled (see the module docstring); `joined`:
    whether the failure came after the process group was up."""
    world_size = int(os.environ["WORLD_SIZE"])
    try:
        store = _agent_store(joined)
        if store is None:
            time.sleep(_NO_STORE_WAIT_S)
            return
        phase = "after_joining" if joined else "before_joining"
        failed = store.add(_key(f"failed_{phase}"), 1)
        deadline = time.monotonic() + (POST_JOIN_WAIT_S if joined else PRE_JOIN_WAIT_S)
        while time.monotonic() < deadline:
            settled = failed if joined else failed + store.add(_key("joined"), 0)
            if settled >= world_size:
                return
            time.sleep(_POLL_S)
            failed = store.add(_key(f"failed_{phase}"), 0)
    except Exception:  # a courtesy wait: whatever keeps it from the store (a peer's exit closed it), the exit goes on
        time.sleep(_NO_STORE_WAIT_S)
