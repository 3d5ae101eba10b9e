"""Process-group setup: the one place where the device and the backend are chosen."""

import gc
import os
from datetime import timedelta

import torch
import torch.distributed as dist


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
    same collectives whatever the launch.
    """
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


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
