"""Tensor parallelism from a plan: the generic half, with no knowledge of any model.

A plan maps submodule paths to DTensor `ParallelStyle`s, exactly as `parallelize_module` takes
it: each dot-separated component is an fnmatch pattern, so "layers.*.attention.wq" names that
projection in every block. Model families write their plan next to the model (for Llama 3:
`torchpre/models/llama3/parallelize.py`); this module checks it and applies it.
"""

from __future__ import annotations

import contextlib
import difflib
import math
from collections.abc import Iterable, Iterator, Sequence
from fnmatch import fnmatch

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement
from torch.distributed.tensor.parallel import ParallelStyle, loss_parallel, parallelize_module

from torchpre.distributed.collectives import all_reduce_tensors
from torchpre.errors import ConfigError


def apply_tensor_parallel(
    module: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, ParallelStyle]
) -> nn.Module:
    """Shard `module` in place over the 1-D `tp_mesh` as `plan` says, and return it.

    The plan is checked first: `parallelize_module` only warns about a key that resolves to
    nothing and skips it, which would turn a typo into a silently replicated layer. On a mesh of
    size 1 the module is returned unchanged, keeping plain tensors and no DTensor overhead.
    """
    check_plan(module, plan)
    if tp_mesh.size() == 1:
        return module
    return parallelize_module(module, tp_mesh, plan)


def check_whole_heads(query: tuple[str, int], key_value: tuple[str, int], tp: int, where: str, fix: str) -> None:
    """Rejects a tensor-parallel degree that splits attention heads: column-parallel q/k/v projections give each
    rank an even share of their output rows, so both head counts (given as (config key, count)) must divide by
    `tp`; each rank's query heads then map onto its own key/value heads. `where` names the model, `fix` adds a
    remedy to the message."""
    for name, heads in (query, key_value):
        if heads % tp:
            common = math.gcd(query[1], key_value[1])
            degrees = ", ".join(str(d) for d in range(1, common + 1) if common % d == 0)
            raise ConfigError(
                f"{where} {name} = {heads} is not divisible by parallelism.tensor_parallel_degree = {tp}: each "
                f"tensor-parallel rank must hold whole attention heads. Set parallelism.tensor_parallel_degree to "
                f"a divisor of both {query[0]} = {query[1]} and {key_value[0]} = {key_value[1]} ({degrees}){fix}."
            )


def check_plan(module: nn.Module, plan: dict[str, ParallelStyle]) -> None:
    """Raise ConfigError if a plan key fails to resolve anywhere `parallelize_module` walks it.

    A wildcard must resolve below every module it matches, so "layers.*.attention.wq" fails if
    any block lacks `attention.wq`.
    """
    for key in plan:
        if key == "":  # parallelize_module's name for `module` itself
            continue
        missing = next(_unresolved_paths(module, key.split(".")), None)
        if missing is not None:
            existing = [name for name, _ in module.named_modules() if name]
            close = difflib.get_close_matches(missing, existing, n=3, cutoff=0.5)
            hint = f" Closest existing: {', '.join(close)}." if close else ""
            raise ConfigError(
                f"The tensor-parallel plan key '{key}' names a module that does not exist: "
                f"'{missing}' is not a submodule of {type(module).__name__}.{hint}"
            )


def _unresolved_paths(module: nn.Module, tokens: list[str], prefix: str = "") -> Iterator[str]:
    """Concrete paths where `tokens` matches no child, walking like `parallelize_module`."""
    token, rest = tokens[0], tokens[1:]
    children = [(name, child) for name, child in module.named_children() if fnmatch(name, token)]
    if not children:
        yield prefix + ".".join(tokens)
    for name, child in children:
        if rest:
            yield from _unresolved_paths(child, rest, f"{prefix}{name}.")


def loss_parallel_context(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """The context in which to compute the loss and run its backward.

    With loss parallel the logits stay sharded over the vocabulary (a `Shard(-1)` DTensor) and
    cross-entropy runs on the shards, so the [tokens, vocab] logits are never all-gathered; the
    backward of that cross-entropy must run inside the same context.
    """
    return loss_parallel() if enabled else contextlib.nullcontext()


def local_gradient(param: nn.Parameter, grad: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """This rank's part of `grad` in `param`'s layout, and whether it is a partial sum over TP.

    DTensor's backward leaves two kinds of gradient laid out unlike their parameter:
    - Partial(sum) for a replicated weight applied to sharded activations (the norms under
      sequence parallel): each rank holds the sum over its own sequence slice, still to be
      all-reduced over TP (the caller does it for many at once).
    - Replicate for a sharded weight (the vocab-parallel embedding: DTensor's embedding
      backward has no row-sharded strategy, so every rank computes the whole [vocab, dim]
      gradient). Keeping only the local rows costs no communication and spares the DP
      reduction, clipping and the optimizer tp times the bytes.
    """
    if not isinstance(grad, DTensor):
        return grad, False
    if grad.placements != param.placements:
        if _is_partial_sum_of_replicated(param.placements, grad.placements):
            return grad.to_local(), True
        grad = grad.redistribute(placements=param.placements)
    return grad.to_local(), False


def reduce_partial_gradients(params: Iterable[nn.Parameter], tp_group: dist.ProcessGroup) -> None:
    """Gives every DTensor gradient its parameter's placements (see `local_gradient`), for a plain
    torch optimizer. Call once per step, after the last backward and before clipping."""
    summed: list[tuple[nn.Parameter, torch.Tensor]] = []
    for param in params:
        if not isinstance(param.grad, DTensor):
            continue
        local, partial = local_gradient(param, param.grad)
        if partial:
            summed.append((param, local))
        else:
            param.grad = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False)
    all_reduce_tensors([local for _, local in summed], tp_group)
    for param, local in summed:
        param.grad = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False)


def _is_partial_sum_of_replicated(own: Sequence[Placement], grad: Sequence[Placement]) -> bool:
    return all(g.is_partial("sum") and o.is_replicate() for g, o in zip(grad, own))
