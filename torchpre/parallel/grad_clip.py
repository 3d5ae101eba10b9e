"""Global gradient-norm clipping over every shard on every stage, each parameter counted once."""

import torch
import torch.distributed as dist


def global_grad_norm(
    grads: list[torch.Tensor],
    tp_sharded: list[bool],
    *,
    tp_group: dist.ProcessGroup,
    pp_group: dist.ProcessGroup,
    dp_group: dist.ProcessGroup | None = None,
    extra_squares: torch.Tensor | None = None,
) -> torch.Tensor:
    """The L2 norm of all gradients of the model, as if it lived in one process.

    `grads` are this rank's local gradients, one per parameter (each weight once, even if tied
    across stages); `tp_sharded[i]` says whether grads[i] is a tensor-parallel shard (else it is
    replicated over TP and counted once). Squares are summed over TP for shards, over `dp_group`
    when the gradients are ZeRO shards (None when they are replicated over DP), and over stages.
    `extra_squares` is a squared norm of other gradients already summed within the stage (the experts').
    """
    device = grads[0].device
    sharded = _sum_of_squares([g for g, s in zip(grads, tp_sharded) if s], device)
    replicated = _sum_of_squares([g for g, s in zip(grads, tp_sharded) if not s], device)
    if dist.get_world_size(tp_group) > 1:
        dist.all_reduce(sharded, group=tp_group)
    total = sharded + replicated
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(total, group=dp_group)
    if extra_squares is not None:
        total = total + extra_squares
    if dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt().float()


def sum_of_squares(grads: list[torch.Tensor], groups: list[dist.ProcessGroup]) -> torch.Tensor:
    """The squared L2 norm of `grads`, summed over each of `groups` (the ranks holding the other shards)."""
    total = _sum_of_squares(grads, grads[0].device)
    for group in groups:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
    return total


def clip_gradients_(grads: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scales every gradient by min(1, max_norm / total_norm), without a host sync."""
    scale = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    torch._foreach_mul_(grads, scale)


def _sum_of_squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """In fp64: an fp32 norm of a large tensor is off by ~1e-5 relative on CPU, and by a different amount for its
    DP shards, so the same gradients would report (and clip by) a norm that depends on the ZeRO stage."""
    nonempty = [t for t in tensors if t.numel()]
    if not nonempty:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack(torch._foreach_norm(nonempty, 2.0, dtype=torch.float64)).square().sum()
