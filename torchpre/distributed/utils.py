"""Process-group setup: the one place where the device and the backend are chosen."""

import gc
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from torchpre.errors import TorchpreError

# comm.timeout_seconds of this process's job, once joined: groups created later and error messages need it.
_timeout: timedelta | None = None


def world_size_from_env() -> int:
    """The number of processes torchrun launched; 1 for a plain `python train.py`."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def select_device() -> torch.device:
    """CUDA (this process's local GPU) when available, else CPU."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def init_distributed(device: torch.device, timeout_s: float = 600) -> None:
    """Joins the job's process group: NCCL on CUDA, gloo on CPU.

    A plain single process gets a world of one (an in-memory store), so the training code runs the
    same collectives whatever the launch. `timeout_s` (comm.timeout_seconds) bounds every wait for a
    peer, so a rank whose peer hung or died fails instead of waiting forever.
    """
    global _timeout
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = _timeout = timedelta(seconds=timeout_s)
    if "WORLD_SIZE" in os.environ:
        device_id = device if device.type == "cuda" else None
        store = _restart_store(timeout)
        if store is None:
            dist.init_process_group(backend, timeout=timeout, device_id=device_id)
        else:
            rank, world_size = int(os.environ["RANK"]), world_size_from_env()
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=world_size, timeout=timeout, device_id=device_id
            )
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def _restart_store(timeout: timedelta) -> dist.Store | None:
    """After a torchrun restart: torchrun's store, with this attempt's keys apart from the dead workers'.

    torchrun (torch >= 2.5) keeps one rendezvous store across restarts, and its workers no longer prefix
    their keys per attempt, so restarted workers read the addresses of the dead ones and cannot connect
    (pytorch/pytorch#135712, #167288). The restart count makes a prefix all ranks agree on when one
    torchrun launched them all; agents on several nodes may count restarts differently, so there the
    store must not be shared. None (plain env:// init) on a first attempt or an unshared store.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or attempt == "0":
        return None
    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1:
        raise TorchpreError(
            "torchrun restarted this multi-node job, but its rendezvous store still holds the addresses of the "
            "workers that died, and restarted workers would connect to them. Launch torchrun with the environment "
            "variable TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a fresh store per restart) to use --max-restarts."
        )
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"torchpre/restart_{attempt}", store)


def comm_timeout() -> timedelta | None:
    """The timeout `init_distributed` gave the job; None before it ran."""
    return _timeout


def apply_comm_timeout(*meshes: DeviceMesh | None) -> None:
    """Gives every group of `meshes` (None: a mesh the layout does not use) the job's timeout.

    PyTorch creates a mesh's sub-groups with its own defaults (30 min on gloo, 10 on NCCL), not the
    world group's timeout, so without this a hung peer would stall a tensor- or pipeline-parallel
    collective far longer than comm.timeout_seconds.
    """
    for mesh in meshes:
        for group in mesh.get_all_groups() if mesh is not None else []:
            _set_group_timeout(group, _timeout)


def _set_group_timeout(group: dist.ProcessGroup, timeout: timedelta) -> None:
    """`dist.set_timeout` where torch has it; torch 2.11 has only the private setter for the same job."""
    if hasattr(dist, "set_timeout"):
        dist.set_timeout(timeout, group)
    else:
        from torch.distributed.distributed_c10d import _set_pg_timeout

        _set_pg_timeout(timeout, group)


def shutdown_distributed() -> None:
    """Tears the group down cleanly, avoiding gloo's intermittent abort at exit.

    Training objects caught in reference cycles (a pipeline schedule, its stages and their pending
    P2P work) are collected first, while the interpreter is whole: left to the finaliser, freeing
    them races gloo's threads and aborts the process. The barrier then lets every rank finish its
    last collective before any rank closes its connections.
    """
    if dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
