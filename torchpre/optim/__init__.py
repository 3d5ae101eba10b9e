"""Optimizers on fp32 masters with ZeRO sharding, chosen by name; see `torchpre.optim.registry`."""

from torchpre.optim.build import build_optimizer
from torchpre.optim.registry import OptimizerSpec, get_optimizer, optimizer_names, register_optimizer

__all__ = ["OptimizerSpec", "build_optimizer", "get_optimizer", "optimizer_names", "register_optimizer"]
