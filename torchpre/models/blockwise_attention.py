"""Attention with an explicit boolean mask that never holds the whole [query, key] score matrix.

Off CUDA, SDPA's only kernel that takes a mask (math) keeps the softmax of every head's [queries, keys] scores for
backward: under context parallelism, where a rank's queries attend to the whole sequence's keys, that is more than
one process's causal flash kernel holds. This computes the attention a block of queries at a time, keeps only the
output and each query's log-sum-exp, and recomputes the scores block by block in backward (the flash-attention
recurrence, in plain PyTorch), so the transient is one block's scores. The numbers are SDPA's up to summation
order. Every query must attend to at least one key (causal masks: itself).
"""

import torch
from torch import Tensor

# Score elements per block (batch x heads x queries x keys): 16 MiB per float32 temporary, of which a block's forward
# and backward hold a few; a block has at least MIN_ROWS queries so that its matmuls stay efficient.
BLOCK_ELEMENTS = 2**22
MIN_ROWS = 16


def blockwise_masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """q [batch, queries, heads, head_dim], k and v [batch, keys, kv_heads, head_dim] (grouped-query: heads a
    multiple of kv_heads; v's head_dim may differ, as in multi-head latent attention), mask broadcastable to
    [batch, 1, queries, keys] (True: attend); returns [batch, queries, heads, v's head_dim]."""
    out = _BlockwiseMaskedAttention.apply(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
    return out.transpose(1, 2)


class _BlockwiseMaskedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:  # [batch, heads, seq, head_dim]
        scale = q.shape[-1] ** -0.5
        keys, values = _repeat_heads(k, q.shape[1]), _repeat_heads(v, q.shape[1])
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        for rows in _blocks(q, keys):
            scores = _scores(q[:, :, rows], keys, mask[..., rows, :], scale)
            lse[:, :, rows] = scores.logsumexp(dim=-1)
            probs = (scores - lse[:, :, rows, None]).exp()
            out[:, :, rows] = (probs.to(values.dtype) @ values).to(q.dtype)
        ctx.save_for_backward(q, k, v, mask, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        q, k, v, mask, out, lse = ctx.saved_tensors
        scale = q.shape[-1] ** -0.5
        keys, values = _repeat_heads(k, q.shape[1]), _repeat_heads(v, q.shape[1])
        grad_q = torch.empty_like(q)
        grad_keys = torch.zeros(keys.shape, dtype=torch.float32, device=k.device)
        grad_values = torch.zeros(values.shape, dtype=torch.float32, device=v.device)
        delta = (grad_out.float() * out.float()).sum(dim=-1)  # rowsum(dO * O) = rowsum(P * dP)
        for rows in _blocks(q, keys):
            scores = _scores(q[:, :, rows], keys, mask[..., rows, :], scale)
            probs = (scores - lse[:, :, rows, None]).exp()
            block_grad = grad_out[:, :, rows]
            grad_values += probs.transpose(-1, -2) @ block_grad.float()
            grad_probs = block_grad.float() @ values.float().transpose(-1, -2)
            grad_scores = probs * (grad_probs - delta[:, :, rows, None]) * scale
            grad_q[:, :, rows] = (grad_scores @ keys.float()).to(q.dtype)
            grad_keys += grad_scores.transpose(-1, -2) @ q[:, :, rows].float()
        return grad_q, _sum_heads(grad_keys, k), _sum_heads(grad_values, v), None


def _blocks(q: Tensor, keys: Tensor) -> list[slice]:
    """Query blocks of about BLOCK_ELEMENTS scores each."""
    batch, heads, length = q.shape[:3]
    size = max(MIN_ROWS, BLOCK_ELEMENTS // (batch * heads * keys.shape[2]))
    return [slice(start, min(start + size, length)) for start in range(0, length, size)]


def _scores(q: Tensor, keys: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Scaled float32 scores [batch, heads, rows, keys], -inf where the mask is False."""
    scores = (q @ keys.transpose(-1, -2)).float() * scale
    return scores.masked_fill(~mask, float("-inf"))


def _repeat_heads(t: Tensor, heads: int) -> Tensor:
    """[batch, kv_heads, seq, dim] -> [batch, heads, seq, dim]: each key/value head serves heads / kv_heads
    consecutive query heads, as SDPA's enable_gqa pairs them."""
    return t.repeat_interleave(heads // t.shape[1], dim=1)


def _sum_heads(grad: Tensor, like: Tensor) -> Tensor:
    """The gradient of `_repeat_heads`: the query heads' shares summed back onto their key/value head."""
    batch, kv_heads, seq, dim = like.shape
    return grad.view(batch, kv_heads, -1, seq, dim).sum(dim=2).to(like.dtype)
