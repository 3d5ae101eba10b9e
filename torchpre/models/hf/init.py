"""Initialisation of transformers models as transformers initialises them, layout-independently.

transformers initialises a model by calling `PreTrainedModel.initialize_weights()`, whose per-module
`_init_weights` fills every parameter and recomputes every buffer through a small set of functions
(`transformers.initialization`: `normal_`, `zeros_`, `ones_`, `constant_`, `copy_`, ... and torch's `nn.init` under
its guard). `init_plan` runs that method once on a meta-device copy of the model with those functions replaced by
recorders, which gives, for every tensor, the operations transformers applies to it in order: Gemma's `(1 + weight)`
RMSNorm weights at zero and its embedding scale at sqrt(hidden_size), GPT-2's residual projections with a smaller
std, a padding row of zeros, the rotary inverse frequencies, and so on, with no list of families.

`init_weights` then replays those operations per parameter on a full float32 CPU tensor, drawing from a generator
seeded by (seed, the parameter's name) (`torchpre.models.init`), and keeps this process's shard; `init_buffers`
replays them for the buffers. So every layout starts from the same values, which follow transformers' recipe.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from torchpre.distributed.names import canonical_fqn
from torchpre.errors import ConfigError
from torchpre.models.hf.args import ConfigKey
from torchpre.models.init import param_generator
from torchpre.optional import import_optional

if TYPE_CHECKING:
    from transformers import PretrainedConfig

RANDOM = ("uniform_", "normal_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_",
          "trunc_normal_", "orthogonal_", "sparse_")  # fmt: skip


@dataclass(frozen=True)
class Op:
    """One initialisation call on a tensor (or on a view of it: `region` = (size, stride, storage offset))."""

    function: str  # a torch.nn.init function name, or "copy_"
    kwargs: tuple[tuple[str, Any], ...]
    region: tuple[tuple[int, ...], tuple[int, ...], int] | None = None
    value: Tensor | None = None  # the source of a copy_

    def apply(self, tensor: Tensor, generator: torch.Generator) -> None:
        target = tensor if self.region is None else tensor.as_strided(*self.region)
        if self.function == "copy_":
            target.copy_(self.value)
            return
        extra = {"generator": generator} if self.function in RANDOM else {}
        getattr(torch.nn.init, self.function)(target, **dict(self.kwargs), **extra)


@dataclass(frozen=True)
class InitPlan:
    """The operations transformers applies to each parameter and buffer, by name; `keys` maps each name to the
    name that seeds its generator (the first name of a tensor that several names share: tied embeddings)."""

    ops: dict[str, tuple[Op, ...]]
    keys: dict[str, str]

    def fill(self, name: str):
        """A `torchpre.models.init.Fill` that replays `name`'s operations."""

        def fill(tensor: Tensor, *, generator: torch.Generator) -> None:
            for op in self.ops[name]:
                op.apply(tensor, generator)

        return fill


def init_weights(module: nn.Module, seed: int) -> None:
    """Initialises every parameter and buffer of `module` (a transformers causal LM, `HFCausalLM`, or a pipeline
    stage of either, materialised and possibly sharded) as transformers would, layout-independently."""
    plan = plan_of(module)
    with torch.no_grad():
        for name, param in module.named_parameters():
            name = canonical_fqn(name)
            _write(param, plan.fill(name), param_generator(seed, plan.keys[name]))
    init_buffers(module)


@torch.no_grad()
def init_buffers(module: nn.Module) -> None:
    """Recomputes every buffer of `module` as transformers computes it (rotary tables, embedding scales, ...): the
    weights come from a checkpoint, which does not hold the non-persistent ones."""
    plan = plan_of(module)
    for name, buffer in module.named_buffers():
        name = canonical_fqn(name)
        full = torch.empty(buffer.shape, dtype=buffer.dtype)
        plan.fill(name)(full, generator=torch.Generator())  # buffers' operations draw nothing (see init_plan)
        (buffer.to_local() if isinstance(buffer, DTensor) else buffer).copy_(full)


def _write(param: Tensor, fill, generator: torch.Generator) -> None:
    """Draws the full parameter in float32 on the CPU and keeps this process's part of it."""
    full = torch.empty(param.shape, dtype=torch.float32)
    fill(full, generator=generator)
    if isinstance(param, DTensor):
        # distribute_tensor takes this rank's part of any placement, strided ones included, without communicating.
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)


def plan_of(module: nn.Module) -> InitPlan:
    """The init plan of the transformers model `module` is (or whose submodules an `HFCausalLM` holds)."""
    model_class = getattr(module, "causal_lm_class", None) or _transformers_class(module)
    return init_plan(model_class, module.config)


def _transformers_class(module: nn.Module) -> type:
    """The transformers class of `module`, under any wrapper class FSDP or torch.compile put over it."""
    for cls in type(module).__mro__:
        if cls.__module__.startswith("transformers."):
            return cls
    raise ConfigError(f"{type(module).__name__} is not a transformers model: its initialisation is not known.")


def init_plan(model_class: type, config: PretrainedConfig) -> InitPlan:
    """Records transformers' initialisation of `model_class` built from `config` on the meta device (once per
    class and config). Raises ConfigError naming a tensor that no recorded operation fills completely,
    a buffer filled at random, or a value transformers computes from the model's own (meta) tensors.

    The model is recorded untied, as transformers initialises it before tying: a tied weight (the output layer of
    tied embeddings) then takes the operations and the generator of the tensor it is tied to."""
    return _init_plan(model_class, ConfigKey(config))


@functools.lru_cache(maxsize=8)
def _init_plan(model_class: type, key: ConfigKey) -> InitPlan:
    initialization = import_optional("transformers.initialization", "model.name = 'hf'", extra="hf")
    config = copy.deepcopy(key.config)
    with torch.device("meta"), initialization.no_tie_weights():
        model = model_class._from_config(config, dtype=torch.float32)
    tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    recorded: dict[int, list[Op]] = {}
    with _recording(recorded, model_class, {id(tensor): name for name, tensor in tensors.items()}):
        model.initialize_weights()
    ties = dict(model.all_tied_weights_keys)
    keys = {name: _tie_source(name, ties) for name in tensors}
    ops = {name: tuple(recorded.get(id(tensors[keys[name]]), ())) for name in tensors}
    buffers = {name for name, _ in model.named_buffers(remove_duplicate=False)}
    _check_complete(model_class, ops, buffers)
    return InitPlan(ops=ops, keys=keys)


def _tie_source(name: str, ties: dict[str, str]) -> str:
    while name in ties:
        name = ties[name]
    return name


def _check_complete(model_class: type, ops: dict[str, tuple[Op, ...]], buffers: set[str]) -> None:
    for name, steps in ops.items():
        if not any(op.region is None for op in steps):
            raise ConfigError(
                f"{model_class.__name__}: transformers' initialisation (_init_weights) does not fill {name} through "
                "transformers.initialization, so torchpre cannot initialise it as transformers does and does not "
                "train this architecture."
            )
        if name in buffers and any(op.function in RANDOM for op in steps):
            raise ConfigError(
                f"{model_class.__name__}: transformers initialises the buffer {name} at random, which torchpre does "
                "not reproduce layout-independently."
            )


@contextlib.contextmanager
def _recording(ops: dict[int, list[Op]], model_class: type, names: dict[int, str]) -> Iterator[None]:
    """Replaces transformers' initialisation functions by recorders of the calls, keyed by the id of the tensor
    (or of the tensor a view belongs to)."""
    initialization = import_optional("transformers.initialization", "model.name = 'hf'", extra="hf")
    table = initialization.TORCH_INIT_FUNCTIONS
    originals = dict(table), initialization.copy_

    def recorder(function: str):
        def record(tensor: Tensor, *args: object, **kwargs: object) -> Tensor:
            kwargs.pop("generator", None)
            parameters = list(_SIGNATURES[function])
            kwargs.update(zip(parameters, args))
            _record(ops, function, tensor, tuple(sorted(kwargs.items())), None)
            return tensor

        return record

    def copy(tensor: Tensor, other: Tensor) -> Tensor:
        if other.is_meta:
            name = names.get(id(tensor if tensor._base is None else tensor._base), f"a {tuple(tensor.shape)} tensor")
            raise ConfigError(
                f"{model_class.__name__}: transformers initialises {name} with values it computes from the model's "
                "own tensors, which torchpre cannot reproduce without materialising the whole model, so it does not "
                "train this architecture."
            )
        _record(ops, "copy_", tensor, (), other.detach().to("cpu", copy=True))
        return tensor

    table.update({function: recorder(function) for function in table})
    initialization.copy_ = copy
    try:
        with initialization.guard_torch_init_functions():
            yield
    finally:
        table.update(originals[0])
        initialization.copy_ = originals[1]


def _record(ops: dict[int, list[Op]], function: str, tensor: Tensor, kwargs: tuple, value: Tensor | None) -> None:
    base = tensor if tensor._base is None else tensor._base
    region = None
    if base is not tensor:
        if not base.is_contiguous():
            raise ConfigError(f"transformers initialises a view of a non-contiguous tensor {tuple(base.shape)}.")
        region = (tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())
    ops.setdefault(id(base), []).append(Op(function, kwargs, region, value))


# The positional parameters after the tensor of each of torch.nn.init's functions, to name positional arguments.
_SIGNATURES: dict[str, tuple[str, ...]] = {
    "uniform_": ("a", "b"), "normal_": ("mean", "std"), "constant_": ("val",), "ones_": (), "zeros_": (),
    "eye_": (), "dirac_": ("groups",), "xavier_uniform_": ("gain",), "xavier_normal_": ("gain",),
    "kaiming_uniform_": ("a", "mode", "nonlinearity"), "kaiming_normal_": ("a", "mode", "nonlinearity"),
    "trunc_normal_": ("mean", "std", "a", "b"), "orthogonal_": ("gain",), "sparse_": ("sparsity", "std"),
}  # fmt: skip
