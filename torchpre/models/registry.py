"""Model families by name: what `model.name` and `model.flavor` resolve to."""

import difflib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from torchpre.errors import ConfigError


@dataclass(frozen=True)
class ModelSpec:
    """How to build, measure and parallelize one model family.

    - `model_cls(args)` builds the plain model; the trainer constructs it on the meta device, then
      calls its `init_weights(seed)` once it is parallelized and materialised.
    - `flops_per_token(args, num_params, seq_len)` feeds MFU.
    - `validate_tensor_parallel(args, tp)` rejects shapes that do not shard, before any work.
    - `apply_tensor_parallel(module, tp_mesh, sequence_parallel=..., loss_parallel=...)` applies the
      family's TP plan to the model or to one pipeline stage of it.
    - `stage_modules(args, num_stages, split_points)` names the modules of each pipeline stage.
    - `tied_weights(args)` names the two copies of a weight that pipeline stages must keep equal.
    """

    name: str
    model_cls: Callable[[Any], nn.Module]
    flavors: dict[str, Any]
    flops_per_token: Callable[[Any, int, int], int]
    validate_tensor_parallel: Callable[[Any, int], None]
    apply_tensor_parallel: Callable[..., None]
    stage_modules: Callable[[Any, int, Sequence[str]], list[list[str]]]
    tied_weights: Callable[[Any], tuple[str, str] | None]


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
    from torchpre.models.llama3.parallelize import apply_llama3_tensor_parallel, validate_llama3_tensor_parallel
    from torchpre.models.llama3.pipeline import llama3_stage_modules, llama3_tied_weights

    register_model(
        ModelSpec(
            name="llama3",
            model_cls=Transformer,
            flavors=LLAMA3_FLAVORS,
            flops_per_token=flops_per_token,
            validate_tensor_parallel=validate_llama3_tensor_parallel,
            apply_tensor_parallel=apply_llama3_tensor_parallel,
            stage_modules=llama3_stage_modules,
            tied_weights=llama3_tied_weights,
        )
    )
