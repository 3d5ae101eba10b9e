"""Optimizers by name: what `optimizer.name` resolves to, and which `optimizer.*` keys each one reads.

Any `torch.optim` class whose update is elementwise (each element's from its own gradient and state) and whose
per-parameter state is tensors shaped like the parameter (plus a scalar `step`) works under ZeRO, TP and EP, since
the distributed optimizer shards and checkpoints that state like the fp32 master, and an elementwise update is the
same computed on any shard. Adding one is one entry here, or `register_optimizer` from a module named by
`job.custom_import`:

    register_optimizer("Adadelta", OptimizerSpec(torch.optim.Adadelta, ("lr", "weight_decay", "eps")))

A checkpoint saved or loaded before the first step needs the state to exist: the distributed optimizer
creates it with one step on zero gradients at lr 0 and puts `step` back to 0 (`_initialise_state`). That is
exact when a zero gradient leaves the other state at its initial value, as for every entry here and Adadelta;
NAdam's `mu_product` and Adamax's `exp_inf` would move, so such a class needs a test of that before joining.

An update that reads whole matrices (Muon, Shampoo, SOAP) is declared `elementwise=False`: it is refused where a
rank holds shards of a matrix unless its class assembles whole matrices (`whole_matrices=True`, as Muon does
through `torchpre.optim.whole_matrices`); elsewhere it would silently train a different model than one process.

`lr` and `weight_decay` are read by every optimizer (weight decay is decoupled for AdamW, an L2 term in the
gradient for the others, as torch defines them; norm gains are never decayed). A key an optimizer does not
read must stay at its default: `check_hyperparameters` rejects a changed one instead of ignoring it.
"""

import difflib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from torchpre.config.job_config import Optimizer
from torchpre.errors import ConfigError, resolve_step
from torchpre.optim.muon import Muon, check_settings


def _frozen(value: object) -> object:
    """A config default as a constructor takes it: lists (Newton-Schulz coefficients, name patterns) as tuples."""
    return tuple(value) if isinstance(value, list) else value


# Constructor arguments the registry knows, each filled from `optimizer.*` config keys. A new one is a row here and a
# field of the config's `Optimizer` section, whose default is the one `build_optimizer` uses too.
HYPERPARAMETER_KEYS = {
    "lr": ("lr",),
    "weight_decay": ("weight_decay",),
    "betas": ("beta1", "beta2"),
    "eps": ("eps",),
    "momentum": ("momentum",),
    "muon_momentum": ("muon_momentum",),
    "muon_nesterov": ("muon_nesterov",),
    "muon_ns_steps": ("muon_ns_steps",),
    "muon_ns_coefficients": ("muon_ns_coefficients",),
    "muon_ns_dtype": ("muon_ns_dtype",),
    "muon_lr_adjust": ("muon_lr_adjust",),
    "muon_adamw_params": ("muon_adamw_params",),
}
_CONFIG_DEFAULTS = Optimizer()
# The config's defaults, by constructor argument: `python train.py --help` and `build_optimizer` agree by construction.
DEFAULT_HYPERPARAMETERS = {
    argument: tuple(getattr(_CONFIG_DEFAULTS, key) for key in keys) if len(keys) > 1
    else _frozen(getattr(_CONFIG_DEFAULTS, keys[0]))
    for argument, keys in HYPERPARAMETER_KEYS.items()
}  # fmt: skip


@dataclass(frozen=True)
class OptimizerSpec:
    """A torch optimizer class and the constructor arguments (keys of `HYPERPARAMETER_KEYS`) it takes from the
    config; the others keep the class's defaults.

    `fused`: use the fused implementation on CUDA; None = whenever the constructor takes `fused`; False = never.
    `elementwise`: whether the update of each element depends on that element's gradient and state only (every
    torch.optim class but Muon and LBFGS). Such an update is the same computed on any shard; one that is not sees
    whole matrices only if the class assembles them (`whole_matrices`: it takes the param groups' "layouts", see
    `DistributedOptimizer`), and is refused where a rank holds shards (ZeRO >= 1, TP, EP) otherwise.
    `check`: validates the values of the keys it reads (by constructor argument), before any work.
    `mup_update`: which per-parameter rule µP and CompleteP apply to its learning rates (torchpre.models.
    parametrization): "adaptive" for an update normalised entrywise (Adam-like), "sgd" for one proportional to the
    gradient; None: no rule is stated, and model.parametrization other than "sp" is refused with it.
    """

    cls: type[torch.optim.Optimizer]
    arguments: tuple[str, ...]
    fused: bool | None = None
    elementwise: bool = True
    whole_matrices: bool = False
    check: Callable[[dict[str, object]], None] | None = None
    mup_update: Literal["adaptive", "sgd"] | None = None

    def __post_init__(self) -> None:
        unknown = set(self.arguments) - set(HYPERPARAMETER_KEYS)
        if unknown or not {"lr", "weight_decay"} <= set(self.arguments):
            raise ValueError(
                f"{self.cls.__name__}: arguments must include lr and weight_decay and come from "
                f"{sorted(HYPERPARAMETER_KEYS)}; got {self.arguments}"
            )
        if self.elementwise and self.cls in NOT_ELEMENTWISE:
            raise ValueError(f"{self.cls.__name__}'s update is not elementwise: register it with elementwise=False")

    def config_keys(self) -> set[str]:
        """The `optimizer.*` keys this optimizer reads."""
        return {key for argument in self.arguments for key in HYPERPARAMETER_KEYS[argument]}

    def has_fused(self) -> bool:
        """Whether the class has a fused implementation that the registry allows."""
        return self.fused is not False and "fused" in inspect.signature(self.cls.__init__).parameters

    def uses_fused(self, device: torch.device, implementation: str = "auto") -> bool:
        """Whether to build the fused implementation for parameters on `device`: by default (`optimizer.implementation
        = "auto"`) on CUDA only, so CPU runs keep the implementation their reference numbers were measured with."""
        if implementation == "fused":
            assert self.has_fused(), f"{self.cls.__name__} has no fused implementation: check_config refuses it"
            return True
        if implementation == "foreach" or device.type != "cuda":
            return False
        return self.fused if self.fused is not None else self.has_fused()


# torch.optim classes whose update of an element reads other elements: they cannot be registered as elementwise.
NOT_ELEMENTWISE = (torch.optim.Muon, torch.optim.LBFGS)

_ADAM = ("lr", "weight_decay", "betas", "eps")
_MUON = (*_ADAM, "muon_momentum", "muon_nesterov", "muon_ns_steps", "muon_ns_coefficients", "muon_ns_dtype",
         "muon_lr_adjust", "muon_adamw_params")  # fmt: skip

_REGISTRY: dict[str, OptimizerSpec] = {
    "AdamW": OptimizerSpec(torch.optim.AdamW, _ADAM, mup_update="adaptive"),
    "Adam": OptimizerSpec(torch.optim.Adam, _ADAM, mup_update="adaptive"),
    "SGD": OptimizerSpec(torch.optim.SGD, ("lr", "weight_decay", "momentum"), mup_update="sgd"),
    # Fused Adagrad was CPU-only in the torch releases this was checked against.
    "Adagrad": OptimizerSpec(torch.optim.Adagrad, ("lr", "weight_decay", "eps"), fused=False, mup_update="adaptive"),
    "RMSprop": OptimizerSpec(torch.optim.RMSprop, ("lr", "weight_decay", "eps", "momentum"), mup_update="adaptive"),
    "Muon": OptimizerSpec(Muon, _MUON, fused=False, elementwise=False, whole_matrices=True, check=check_settings),
}


def register_optimizer(name: str, spec: OptimizerSpec) -> None:
    """Makes `optimizer.name = name` available; a name already taken is a ValueError (a bug in the registering code)."""
    if name in _REGISTRY:
        raise ValueError(f"An optimizer named '{name}' is already registered ({_REGISTRY[name].cls.__name__}).")
    _REGISTRY[name] = spec


def optimizer_names() -> list[str]:
    return list(_REGISTRY)


def get_optimizer(name: str) -> OptimizerSpec:
    """The spec of `optimizer.name = name`; an unknown name is a ConfigError listing the valid ones."""
    if name not in _REGISTRY:
        same_letters = [known for known in _REGISTRY if known.lower() == name.lower()]
        close = same_letters or difflib.get_close_matches(name, _REGISTRY, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigError(
            f"optimizer.name = '{name}' is not a registered optimizer.{hint} Choose one of: {', '.join(_REGISTRY)}."
        )
    return _REGISTRY[name]


def config_keys() -> list[str]:
    """Every `optimizer.*` key that some optimizer reads."""
    return [key for keys in HYPERPARAMETER_KEYS.values() for key in keys]


def hyperparameters_from_config(values: dict[str, object]) -> dict[str, object]:
    """Constructor arguments by name from `optimizer.*` values by key (beta1 and beta2 make betas)."""
    return {
        argument: tuple(values[k] for k in keys) if len(keys) > 1 else values[keys[0]]
        for argument, keys in HYPERPARAMETER_KEYS.items()
    }


@resolve_step
def check_config(section: Optimizer, shards: dict[str, bool]) -> None:
    """`optimizer.name` is registered, no `optimizer.*` key it does not read is set away from its default, the
    values it reads are valid, optimizer.implementation = 'fused' only where it has one, and an update that is not
    elementwise is not computed on shards (`shards`: each setting of the layout, e.g. "optimizer.zero_stage = 1", and
    whether it leaves ranks holding shards)."""
    keys, defaults = config_keys(), Optimizer()
    values = {k: getattr(section, k) for k in keys}
    check_hyperparameters(section.name, values, {k: getattr(defaults, k) for k in keys})
    spec = get_optimizer(section.name)
    if spec.check is not None:
        spec.check(hyperparameters_from_config(values))
    if section.implementation == "fused" and not spec.has_fused():
        raise ConfigError(
            f"optimizer.implementation = 'fused': {spec.cls.__name__} has no fused implementation here; use 'auto' or "
            "'foreach'."
        )
    sharded = [setting for setting, holds_shards in shards.items() if holds_shards]
    if not spec.elementwise and not spec.whole_matrices and sharded:
        raise ConfigError(
            f"optimizer.name = '{section.name}': its update is not elementwise (it reads whole matrices), and it has "
            f"no distributed implementation, so with {' and '.join(sharded)} each rank would update its shards on "
            "their own and train a different model than one process. Use optimizer.zero_stage = 0 without tensor "
            "or expert parallelism (data and pipeline parallelism keep matrices whole), or Muon, which assembles "
            "whole matrices under every layout."
        )


def check_hyperparameters(name: str, values: dict[str, float], defaults: dict[str, float]) -> None:
    """Rejects an `optimizer.*` key set away from its default for an optimizer that does not read it."""
    spec = get_optimizer(name)
    ignored = sorted(key for key in set(values) - spec.config_keys() if values[key] != defaults[key])
    if ignored:
        settings = ", ".join(f"optimizer.{key} = {values[key]}" for key in ignored)
        raise ConfigError(
            f"{settings}: {name} does not use {'this key' if len(ignored) == 1 else 'these keys'}. It reads "
            f"optimizer.{', optimizer.'.join(sorted(spec.config_keys()))}; remove the other settings or choose "
            "an optimizer that uses them."
        )


def constructor_kwargs(spec: OptimizerSpec, hyperparameters: dict[str, object]) -> dict[str, object]:
    """The keyword arguments of `spec.cls` out of `hyperparameters` (by constructor argument), weight decay
    excluded: it is set per parameter group."""
    return {argument: hyperparameters[argument] for argument in spec.arguments if argument != "weight_decay"}
