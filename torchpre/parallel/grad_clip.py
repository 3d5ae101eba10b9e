"""Global gradient-norm clipping over every shard on every stage, each parameter counted once."""

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard


def global_grad_norm(
    params: Iterable[nn.Parameter],
    device: torch.device,
    tp_group: dist.ProcessGroup | None = None,
    pp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The L2 norm of all gradients of the model, as if it lived in one process.

    Tensor-parallel shards are summed over `tp_group` (their squares), replicated parameters are
    counted once, and stages are summed over `pp_group`. The caller passes each parameter once
    (one copy of a weight tied across stages). Gradients must already be reduced over DP.
    """
    sharded, replicated = [], []
    for param in params:
        if param.grad is None:
            continue
        grad = param.grad
        if isinstance(grad, DTensor):
            is_sharded = any(isinstance(p, Shard) for p in grad.placements)
            (sharded if is_sharded else replicated).append(grad.to_local())
        else:
            replicated.append(grad)
    sharded_sq = _sum_of_squares(sharded, device)
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(sharded_sq, group=tp_group)
    total_sq = sharded_sq + _sum_of_squares(replicated, device)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total_sq, group=pp_group)
    return total_sq.sqrt()


def clip_gradients_(params: Iterable[nn.Parameter], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scales every gradient by min(1, max_norm / total_norm), without a host sync."""
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
    if grads:
        scale = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        torch._foreach_mul_(grads, scale)


def _sum_of_squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm(tensors, 2.0)
    return torch.stack([n.float() for n in norms]).square().sum()
