"""Optimizers on fp32 masters under every ZeRO stage, chosen by name; see `torchpre.optim.registry`."""

from torchpre.optim.build import build_optimizer, build_optimizer_from_config
from torchpre.optim.registry import OptimizerSpec, get_optimizer, optimizer_names, register_optimizer

__all__ = [
    "OptimizerSpec", "build_optimizer", "build_optimizer_from_config", "get_optimizer", "optimizer_names",
    "register_optimizer",
]
