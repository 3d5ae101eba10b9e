"""Causal self-attention kernels: flash-attn when it can run, PyTorch SDPA otherwise; and
document-causal attention for packed sequences: flex_attention on CUDA, SDPA with a dense mask elsewhere.

All take and return [batch, seq, heads, head_dim] tensors and handle grouped-query attention
(fewer key/value heads than query heads) without repeating the keys and values.
"""

import contextlib
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from torchpre.models.blockwise_attention import blockwise_masked_attention

try:  # the `gpu` extra
    from flash_attn import flash_attn_func
except ImportError:
    flash_attn_func = None

FLASH_DTYPES = (torch.bfloat16, torch.float16)


def flash_attention_applies(device: torch.device, dtype: torch.dtype) -> bool:
    """flash-attn is installed and supports these inputs: CUDA tensors in bf16 or fp16."""
    return flash_attn_func is not None and device.type == "cuda" and dtype in FLASH_DTYPES


def causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Each position attends to itself and the positions before it. flash-attn needs the values' head size to be
    the queries' (multi-head latent attention's differ)."""
    if flash_attention_applies(q.device, q.dtype) and v.shape[-1] == q.shape[-1]:
        # training.deterministic turns on deterministic algorithms: flash-attn's backward must follow.
        return flash_attn_func(q, k, v, causal=True, deterministic=torch.are_deterministic_algorithms_enabled())
    return sdpa(q, k, v, mask=None, is_causal=True)


# SDPA's backends on CUDA in the order to try them: cuDNN's attention is the fastest on Hopper, then flash,
# memory-efficient and math. SDPA takes the first one that supports the inputs (dtype, mask, head size,
# deterministic mode), so the order never makes a call fail.
CUDA_SDPA_PRIORITY = (
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
)


def sdpa_backend_priority(device: torch.device) -> tuple[SDPBackend, ...] | None:
    """The SDPA backends to try, in order, on `device`; None leaves SDPA its own choice (off CUDA, one kernel
    serves). `sdpa_kernel(..., set_priority=True)` exists since torch 2.6; torchpre needs 2.11."""
    return CUDA_SDPA_PRIORITY if device.type == "cuda" else None


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool) -> Tensor:
    """`F.scaled_dot_product_attention` in the [batch, seq, heads, head_dim] layout, trying the backends in
    the order of `sdpa_backend_priority`."""
    priority = sdpa_backend_priority(q.device)
    backends = sdpa_kernel(list(priority), set_priority=True) if priority else contextlib.nullcontext()
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    with backends:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=True)
    return out.transpose(1, 2)


def masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """Attention with an explicit boolean mask (True: attend), as context parallelism's gathered attention calls it.
    On CUDA SDPA's fused kernels (memory-efficient, cuDNN) take the mask without holding the scores, though SDPA
    first turns it into an additive mask of the queries' dtype, which the kernel keeps for backward; elsewhere
    SDPA's masked kernel would keep every head's [queries, keys] probabilities for backward, so the attention runs
    a block of queries at a time (`blockwise_masked_attention`). On meta (the dry run and the planner, which size a
    GPU job) it runs as on CUDA: one op per layer that the probe counts as that kernel, additive mask included."""
    if q.device.type in ("cuda", "meta"):
        return sdpa(q, k, v, mask=mask, is_causal=False)
    return blockwise_masked_attention(q, k, v, mask)


# A document mask as the kernel of its device wants it: `document_mask` builds it once per forward,
# every layer reuses it. Or the attention itself, (q, k, v) -> output, when an outside hook owns the mask
# (context parallelism: `torchpre.parallel.context_parallel.ContextParallel.attend`).
DocumentMask = Tensor | BlockMask | Callable[[Tensor, Tensor, Tensor], Tensor]


def flex_max_autotune(device: torch.device) -> bool:
    """Autotune flex_attention's kernels on CUDA (max-autotune without CUDA graphs, as torchtitan does),
    except under deterministic algorithms: autotuning picks kernels by timing them, so two runs may differ."""
    return device.type == "cuda" and not torch.are_deterministic_algorithms_enabled()


def flex_compile_options(max_autotune: bool) -> dict[str, bool]:
    """Inductor options for flex_attention. The compiled call is always wrapped as one operator
    (`inductor_compiled_code`), so that per-op activation checkpointing can keep its output."""
    options = {"wrap_inductor_compiled_regions": True}
    if max_autotune:
        options |= {"max_autotune": True, "coordinate_descent_tuning": True, "triton.cudagraphs": False}
    return options


# Eager flex_attention is a slow reference implementation; compiled, it is a block-sparse kernel that
# skips the blocks the mask removes (compiled lazily, on the first call), one per value of `flex_max_autotune`.
# Eager create_block_mask materializes the whole [batch, seq, seq] mask; compiled, it evaluates it block by block.
_compiled_flex_attention = {
    max_autotune: torch.compile(flex_attention, options=flex_compile_options(max_autotune))
    for max_autotune in (False, True)
}
_compiled_create_block_mask = partial(create_block_mask, _compile=True)


def flex_attention_applies(device: torch.device) -> bool:
    """flex_attention's compiled kernels target CUDA; elsewhere the dense SDPA mask is cheaper than
    compiling them (and needs no compiler)."""
    return device.type == "cuda"


def document_mask(document_ids: Tensor) -> DocumentMask:
    """The document-causal mask of document ids [batch, seq]: position i attends to position j <= i
    only when both lie in the same document. A BlockMask for flex_attention on CUDA (memory and work
    grow with the kept blocks, not seq^2), else a boolean [batch, 1, seq, seq] SDPA mask."""
    if flex_attention_applies(document_ids.device):
        return _document_block_mask(document_ids)
    same_document = document_ids[:, :, None] == document_ids[:, None, :]
    return same_document.tril()[:, None]


def _document_block_mask(document_ids: Tensor) -> BlockMask:
    """flex_attention's form of the document-causal mask, broadcast over heads."""

    def document_causal(batch: Tensor, head: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (q_idx >= kv_idx) & (document_ids[batch, q_idx] == document_ids[batch, kv_idx])

    bsz, seqlen = document_ids.shape
    return _compiled_create_block_mask(document_causal, bsz, None, seqlen, seqlen, device=document_ids.device)


def document_causal_attention(q: Tensor, k: Tensor, v: Tensor, mask: DocumentMask) -> Tensor:
    """Causal attention that does not cross document boundaries, with a mask from `document_mask` (or an
    attention function that holds its own mask)."""
    if callable(mask) and not isinstance(mask, (Tensor, BlockMask)):
        return mask(q, k, v)
    if isinstance(mask, BlockMask):
        out = _compiled_flex_attention[flex_max_autotune(q.device)](
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask, enable_gqa=True
        )
        return out.transpose(1, 2)
    return sdpa(q, k, v, mask=mask, is_causal=False)
