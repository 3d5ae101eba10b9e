"""Layout-independent parameter initialization.

Each parameter is drawn from its own generator, seeded from (seed, the parameter's name), as a
full float32 tensor on CPU; a process then keeps only the part it holds. The initial weights are
therefore a function of the seed and the model, not of the device, the dtype, the sharding or
which pipeline stage holds which layers. Building the model on the meta device first means no
memory is spent on a throwaway default initialization:

    with torch.device("meta"):
        model = Model(args)
    parallelize(model)                   # optional: DTensor parameters
    model.to_empty(device=device)
    init_parameters(model, seed, rule)
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from torchpre.distributed.names import canonical_fqn


class Fill(Protocol):
    """Fills a full float32 CPU tensor in place, drawing only from `generator`.

    `functools.partial(torch.nn.init.normal_, std=0.02)` is one.
    """

    def __call__(self, tensor: Tensor, *, generator: torch.Generator) -> object: ...


@dataclass(frozen=True)
class ParamInit:
    """How to initialize one parameter. `key` seeds its generator: parameters with the same key
    and fill start equal, e.g. tied embeddings that live on different pipeline stages."""

    key: str
    fill: Fill


InitRule = Callable[[str], ParamInit]
"""Maps a canonical parameter FQN to its `ParamInit`; raises for a name it does not know."""


def ones(tensor: Tensor, *, generator: torch.Generator) -> None:
    """A `Fill` for norm weights; draws nothing."""
    tensor.fill_(1.0)


def zeros(tensor: Tensor, *, generator: torch.Generator) -> None:
    """A `Fill` for biases; draws nothing."""
    tensor.zero_()


def param_generator(seed: int, key: str) -> torch.Generator:
    """A CPU generator seeded from a stable hash of (seed, key); Python's `hash` is salted."""
    digest = hashlib.sha256(f"{seed}/{key}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def shard_slices(local_shape: tuple[int, ...], global_offset: tuple[int, ...]) -> tuple[slice, ...]:
    """Index of the block of a full tensor that starts at `global_offset` with `local_shape`."""
    return tuple(slice(start, start + size) for start, size in zip(global_offset, local_shape))


def local_part(full: Tensor, param: Tensor) -> Tensor:
    """The part of `full` that `param` holds: all of it, or the local shard of a DTensor."""
    if not isinstance(param, DTensor):
        return full
    local_shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    return full[shard_slices(local_shape, offset)]


@torch.no_grad()
def init_parameters(module: nn.Module, seed: int, rule: InitRule) -> None:
    """Initialize every parameter of `module` in place as `rule` says.

    A parameter shared under several names is initialized once. Parameters must already be
    materialized (call `module.to_empty(device=...)` after building on the meta device).
    """
    for fqn, param in module.named_parameters():
        if param.is_meta:
            raise RuntimeError(
                f"parameter {fqn!r} is on the meta device; call module.to_empty(device=...) "
                "before initializing"
            )
        _init_parameter(param, rule(canonical_fqn(fqn)), seed)


def _init_parameter(param: Tensor, init: ParamInit, seed: int) -> None:
    """Draws the full parameter and keeps this process's part. The full tensor dies on return, before the
    next parameter's is allocated: at most one is alive at a time."""
    full = torch.empty(param.shape, dtype=torch.float32, device="cpu")
    init.fill(full, generator=param_generator(seed, init.key))
    target = param.to_local() if isinstance(param, DTensor) else param
    target.copy_(local_part(full, param))
