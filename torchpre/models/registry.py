"""Model families by name: what `model.name` and `model.flavor` resolve to."""

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from torchpre.errors import ConfigError


@dataclass(frozen=True)
class ModelSpec:
    """How to build and measure one model family.

    `model_cls(args)` builds the plain model; the trainer constructs it on the meta device and
    calls its `init_weights(seed)`. `flops_per_token(args, num_params, seq_len)` feeds MFU.
    """

    name: str
    model_cls: Callable[[Any], nn.Module]
    flavors: dict[str, Any]
    flops_per_token: Callable[[Any, int, int], int]


_REGISTRY: dict[str, ModelSpec] = {}


def register_model(spec: ModelSpec) -> None:
    """Makes `model.name = spec.name` available to train.py."""
    _REGISTRY[spec.name] = spec


def get_model_spec(name: str) -> ModelSpec:
    _register_builtin_models()
    if name not in _REGISTRY:
        raise ConfigError(f"model.name = '{name}' is not a registered model.{_suggest(name, _REGISTRY)}")
    return _REGISTRY[name]


def get_flavor(spec: ModelSpec, flavor: str) -> Any:
    if flavor not in spec.flavors:
        raise ConfigError(
            f"model.flavor = '{flavor}' is not a flavor of '{spec.name}'.{_suggest(flavor, spec.flavors)}"
        )
    return spec.flavors[flavor]


def _suggest(name: str, choices: dict[str, Any]) -> str:
    close = difflib.get_close_matches(name, choices, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return f"{hint} Choose one of: {', '.join(choices)}."


def _register_builtin_models() -> None:
    if "llama3" in _REGISTRY:
        return
    from torchpre.models.llama3.args import LLAMA3_FLAVORS, flops_per_token
    from torchpre.models.llama3.model import Transformer

    register_model(ModelSpec("llama3", Transformer, LLAMA3_FLAVORS, flops_per_token))
