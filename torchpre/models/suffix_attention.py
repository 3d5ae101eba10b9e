"""Causal attention of a sequence's last positions: queries [batch, L, heads, dim] are positions S - L .. S - 1 of
the S keys and values, and each attends to the keys up to its own position (the lower-right-aligned causal mask).

Context parallelism attends this way: a rank's query chunk sees the prefix of the whole sequence's keys that ends
at the chunk. No [L, S] mask is built on any device:

- CUDA: flash-attn's causal kernel, which aligns the mask to the lower right when L < S (flash-attn >= 2.1), else
  SDPA with torch's `causal_lower_right` bias, which runs the flash or memory-efficient kernel with their own
  lower-right causal mode (`_torch_suffix_attention`; where neither kernel takes the inputs, e.g. fp32 with
  grouped-query heads, torch materializes the mask). Neither has run on a GPU here: the lower-right numbers are
  checked on CPU, where torch materializes the same bias.
- meta (the dry run and the planner size GPU jobs): SDPA's causal kernel on the same shapes, which the activation
  probe counts as the flash kernel (output and log-sum-exp kept for backward), as the CUDA kernels keep.
- CPU: two calls of the CPU flash kernel, the S - L keys before the chunk in full and the last L causally (square,
  so upper- and lower-right agree), merged by their log-sum-exps (`_PrefixThenCausal`). Backward runs the flash
  backward of each part with the merged output and log-sum-exp, which gives each part's exact share of the
  gradients (as ring attention merges its steps).
"""

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from torchpre.models.attention import flash_attention_applies, flash_attn_func, sdpa

_cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_cpu_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def causal_suffix_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """q [batch, L, heads, dim] the last L of the S positions of k [batch, S, kv_heads, dim] and v [batch, S,
    kv_heads, v_dim] (grouped-query: heads a multiple of kv_heads; v_dim may be narrower, as in multi-head latent
    attention); returns [batch, L, heads, v_dim]."""
    if q.device.type == "cuda":
        if flash_attention_applies(q.device, q.dtype) and v.shape[-1] == q.shape[-1]:
            deterministic = torch.are_deterministic_algorithms_enabled()
            return flash_attn_func(q, k, v, causal=True, deterministic=deterministic)
        return _torch_suffix_attention(q, k, v)
    if q.device.type == "meta":
        return sdpa(q, k, v, mask=None, is_causal=True)
    return _cpu_suffix_attention(q, k, v)


def _torch_suffix_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """SDPA with torch's lower-right causal bias: on CUDA its flash or memory-efficient kernel applies the mask
    itself; elsewhere torch materializes it (how the tests check this path's numbers on CPU)."""
    return sdpa(q, k, v, mask=causal_lower_right(q.shape[1], k.shape[1]), is_causal=False)


def _cpu_suffix_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """The CPU flash kernel twice, merged. It takes values only as wide as the queries, so narrower ones are padded
    with zeros (which add zero columns to the output, cut off here)."""
    v_dim = v.shape[-1]
    if v_dim < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - v_dim))
    split = k.shape[1] - q.shape[1]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    out = _PrefixThenCausal.apply(q, k[:, :, :split], v[:, :, :split], k[:, :, split:], v[:, :, split:])
    return out.transpose(1, 2)[..., :v_dim]


class _PrefixThenCausal(torch.autograd.Function):
    """Queries q [batch, heads, L, dim] over the keys before them (k_prefix, v_prefix: every one visible) and their
    own L positions (k_own, v_own: causal); kv heads may be fewer than q's (the CPU kernel pairs them as SDPA's
    enable_gqa does)."""

    @staticmethod
    def forward(ctx, q: Tensor, k_prefix: Tensor, v_prefix: Tensor, k_own: Tensor, v_own: Tensor) -> Tensor:
        out, lse = _cpu_flash(q, k_own, v_own, is_causal=True)
        if k_prefix.shape[2]:
            out_prefix, lse_prefix = _cpu_flash(q, k_prefix, v_prefix)
            merged_lse = torch.logaddexp(lse, lse_prefix)
            weight, weight_prefix = (torch.exp(x - merged_lse).unsqueeze(-1) for x in (lse, lse_prefix))
            out, lse = (weight * out + weight_prefix * out_prefix).to(q.dtype), merged_lse
        ctx.save_for_backward(q, k_prefix, v_prefix, k_own, v_own, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        q, k_prefix, v_prefix, k_own, v_own, out, lse = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_q, grad_k_own, grad_v_own = _cpu_flash_backward(grad_out, q, k_own, v_own, out, lse, 0.0, True)
        if k_prefix.shape[2]:
            grad_q_prefix, grad_k_prefix, grad_v_prefix = _cpu_flash_backward(
                grad_out, q, k_prefix, v_prefix, out, lse, 0.0, False
            )
            grad_q = grad_q + grad_q_prefix
        else:
            grad_k_prefix, grad_v_prefix = torch.zeros_like(k_prefix), torch.zeros_like(v_prefix)
        return grad_q, grad_k_prefix, grad_v_prefix, grad_k_own, grad_v_own
