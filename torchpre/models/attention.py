"""Causal self-attention kernels: flash-attn when it can run, PyTorch SDPA otherwise.

Both take and return [batch, seq, heads, head_dim] tensors and handle grouped-query attention
(fewer key/value heads than query heads) without repeating the keys and values.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

try:  # the `gpu` extra
    from flash_attn import flash_attn_func
except ImportError:
    flash_attn_func = None

FLASH_DTYPES = (torch.bfloat16, torch.float16)


def flash_attention_applies(device: torch.device, dtype: torch.dtype) -> bool:
    """flash-attn is installed and supports these inputs: CUDA tensors in bf16 or fp16."""
    return flash_attn_func is not None and device.type == "cuda" and dtype in FLASH_DTYPES


def causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Each position attends to itself and the positions before it."""
    if flash_attention_applies(q.device, q.dtype):
        return flash_attn_func(q, k, v, causal=True)
    return sdpa(q, k, v, mask=None, is_causal=True)


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool) -> Tensor:
    """`F.scaled_dot_product_attention` in the [batch, seq, heads, head_dim] layout; SDPA picks its own
    backend (flash, memory-efficient, cuDNN or the CPU kernel)."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=is_causal, enable_gqa=True
    )
    return out.transpose(1, 2)
