"""Bitwise-reproducible runs (`training.deterministic`): the same config on the same layout gives the same
losses and weights, bit for bit, which is what debugging a divergence or bisecting a regression needs."""

import os
import random

import numpy as np
import torch


def configure_determinism(enabled: bool, seed: int) -> None:
    """Seeds every RNG and restricts PyTorch to deterministic kernels; does nothing unless `enabled`.

    Must run before the first CUDA matmul: cuBLAS reads CUBLAS_WORKSPACE_CONFIG when it creates its
    handle, and without a fixed workspace its split-K reductions vary from run to run. Deterministic
    kernels and no cuDNN autotuning cost speed on GPU; on CPU the fp32 training path is deterministic
    already, so the flag mostly guards against ops that are not.
    """
    if not enabled:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
