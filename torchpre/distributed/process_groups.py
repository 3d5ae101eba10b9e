"""Process-group setup: the one place where the device and the backend are chosen."""

import gc
import logging
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from torchpre.distributed.elastic import die_with_agent
from torchpre.distributed.peer_exit import count_joined
from torchpre.errors import TorchpreError

logger = logging.getLogger("torchpre")

# The timeout in force for this process's groups, and the config key that set it: groups created later and error
# messages need them. comm.init_timeout_seconds from joining until the first step is done, then comm.timeout_seconds.
_timeout: timedelta | None = None
_timeout_key = "comm.init_timeout_seconds"


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


def configure_float32_matmuls(device: torch.device, tf32: bool) -> None:
    """On CUDA, fp32 matmuls on TF32 tensor cores (`tf32`, torch's "high") or in full fp32 ("highest"). Process-
    wide, so set only for a CUDA job: CPU numerics stay as they are (the layout parity tests compare fp32)."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high" if tf32 else "highest")


# The NCCL flight recorder's settings (torch reads them once, when the first NCCL group is created); torch >= 2.9
# also reads the TORCH_FR_ names, which win over the TORCH_NCCL_ ones.
FLIGHT_RECORDER_SIZE_VARIABLES = ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE")
FLIGHT_RECORDER_FILE_VARIABLES = ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE")


def configure_flight_recorder(buffer_size: int, folder: Path) -> None:
    """Sets the environment of the NCCL flight recorder (comm.trace_buf_size) before any process group exists:
    each rank keeps its last `buffer_size` collectives and, when one times out, dumps them to `folder`/rank_N,
    which `python -m torch.distributed.flight_recorder.fr_trace` merges to show which rank stopped where.
    0 turns the recorder off. Variables a user exported are overridden, with a warning, as torchtitan does."""
    values = {name: str(buffer_size) for name in FLIGHT_RECORDER_SIZE_VARIABLES}
    if buffer_size > 0:
        folder.mkdir(parents=True, exist_ok=True)
        values["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
        values |= {name: f"{folder}/rank_" for name in FLIGHT_RECORDER_FILE_VARIABLES}
    for name, value in values.items():
        if os.environ.get(name, value) != value:
            logger.warning("comm.trace_buf_size replaces %s=%s of the environment by %s", name, os.environ[name], value)
        os.environ[name] = value


def init_distributed(device: torch.device, timeout_s: float = 600) -> None:
    """Joins the job's process group: NCCL on CUDA, gloo on CPU.

    A plain single process gets a world of one (an in-memory store), so the training code runs the
    same collectives whatever the launch. `timeout_s` (comm.init_timeout_seconds) bounds every wait for a
    peer during start-up, so a rank whose peer hung or died fails instead of waiting forever;
    `set_comm_timeout` replaces it once training runs. A torchrun worker dies with its agent (`die_with_agent`).
    """
    global _timeout, _timeout_key
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = _timeout = timedelta(seconds=timeout_s)
    _timeout_key = "comm.init_timeout_seconds"
    if "WORLD_SIZE" in os.environ:
        die_with_agent()
        count_joined()  # past the checks: a peer that failed them need not wait for this rank
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
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    multi_node = int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1
    if attempt == "0":
        if multi_node and os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") != "0" and os.environ.get("RANK") == "0":
            logger.warning(
                "this multi-node job may be restarted (--max-restarts) but shares torchrun's rendezvous store: a "
                "restart would stop with an error, and a node joining an elastic job (--nnodes MIN:MAX) makes the "
                "agents fail. Launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment."
            )
        return None
    if multi_node:
        raise TorchpreError(
            "torchrun restarted this multi-node job, but its rendezvous store still holds the addresses of the "
            "workers that died, and restarted workers would connect to them. Launch torchrun with the environment "
            "variable TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a fresh store per restart) to use --max-restarts."
        )
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"torchpre/restart_{attempt}", store)


def comm_timeout() -> timedelta | None:
    """The timeout in force (see `comm_timeout_key`); None before `init_distributed` ran."""
    return _timeout


def comm_timeout_key() -> str:
    """The config key of the timeout in force: comm.init_timeout_seconds during start-up, then comm.timeout_seconds."""
    return _timeout_key


def apply_comm_timeout(*meshes: DeviceMesh | None) -> None:
    """Gives every group of `meshes` (None: a mesh the layout does not use) the timeout in force.

    PyTorch creates a mesh's sub-groups with its own defaults (30 min on gloo, 10 on NCCL), not the
    world group's timeout, so without this a hung peer would stall a tensor- or pipeline-parallel
    collective far longer than the configured timeout.
    """
    for mesh in meshes:
        for group in mesh.get_all_groups() if mesh is not None else []:
            _set_group_timeout(group, _timeout)


def set_comm_timeout(timeout_s: float, key: str) -> None:
    """From now on every group of this process (the world, the meshes' sub-groups, a checkpoint's background
    group) waits `timeout_s` for a peer; `key` names the setting in error messages.

    The trainer calls it on every rank after the first step, whose compilation and checkpoint loading may keep
    ranks apart far longer than a training step does. A barrier first, under the start-up timeout: a rank
    still in start-up must not make a faster peer time out under the shorter training timeout (torchtitan's
    `set_pg_timeouts` does the same).
    """
    global _timeout, _timeout_key
    dist.barrier()
    _timeout, _timeout_key = timedelta(seconds=timeout_s), key
    for group in list(dist.distributed_c10d._world.pg_map):
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
