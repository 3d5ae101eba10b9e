"""The optimizer of a model's trainable parameters."""

from collections.abc import Iterable

import torch
from torch import nn


def build_optimizer(
    params: Iterable[nn.Parameter], *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float
) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (linear and embedding weights) only.

    Norm gains and biases are not decayed: pulling a gain towards 0 fights the normalisation it
    is there to scale (the Megatron and GPT-3 convention).
    """
    params = [p for p in params if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps)
