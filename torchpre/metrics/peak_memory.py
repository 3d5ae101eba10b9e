"""Peak memory of this process on its device."""

import resource

import torch


def max_memory_bytes(device: torch.device) -> int:
    """The CUDA allocator's peak on GPU; the peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
