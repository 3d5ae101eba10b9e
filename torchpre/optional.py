"""Optional third-party packages, imported when a feature that needs them is turned on.

At the bottom of the package so that config validation (which checks them on every rank before any work)
and the metrics sinks (which use them) both import this, not each other.
"""

import importlib
from types import ModuleType

from torchpre.errors import ConfigError


def import_optional(module: str, feature: str, extra: str = "metrics") -> ModuleType:
    """Imports an optional dependency, or fails with a message naming the feature that needs it and the
    install command (of the package extra `extra`), so a user who turned on a tracker learns what to do instead
    of reading a traceback."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ConfigError(
            f"{feature} needs the '{module}' package, which cannot be imported ({error}). "
            f"Install it with `pip install torchpre[{extra}]`, or turn {feature} off."
        ) from error


def import_wandb() -> ModuleType:
    """`wandb`, or the error that says to install it: checked at config validation on every rank."""
    return import_optional("wandb", "metrics.enable_wandb")


def import_tensorboard() -> ModuleType:
    """torch's SummaryWriter module, which needs the `tensorboard` package."""
    return import_optional("torch.utils.tensorboard", "metrics.enable_tensorboard")
