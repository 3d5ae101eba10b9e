"""Causal attention of a sequence's last positions (context parallelism's query chunks over the key prefix that
ends at them) computes the lower-right causal attention: output and q/k/v gradients against SDPA with the
materialized mask in float64, for the CPU kernel (the flash kernel twice, merged by log-sum-exp) and for the path
CUDA takes without flash-attn (torch's `causal_lower_right` bias, which torch materializes on a CPU); with
grouped-query heads, values narrower than the queries (multi-head latent attention) and a chunk with no prefix."""

import pytest
import torch
import torch.nn.functional as F

from torchpre.models import suffix_attention
from torchpre.models.suffix_attention import causal_suffix_attention

# fp32 against float64: measured within 1.3e-6 on outputs and gradients of magnitude up to 3.2 (fp32 spacing at 2 is
# 2.4e-7; the kernels sum in another order); bf16 keeps 8 bits: within 1.6e-2 (spacing at 2 is 1.6e-2). A wrong
# alignment of the mask moves rows by O(0.1).
ATOL = {torch.float32: 2e-6, torch.bfloat16: 5e-2}
SHAPES = [(8, 24, 4, 2, 8, 8), (16, 16, 4, 4, 8, 8), (12, 36, 6, 2, 12, 8)]
SHAPE_IDS = ["prefix_gqa", "no_prefix", "narrow_values"]


def _reference(q, k, v):
    mask = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril(k.shape[1] - q.shape[1])
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True
    )
    return out.transpose(1, 2)


def _results(attention, q, k, v, weights, dtype):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out = attention(*leaves)
    (out.double() * weights).sum().backward()
    return [out.detach().double(), *(t.grad.double() for t in leaves)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kernel", ["cpu", "torch_bias"])
@pytest.mark.parametrize("queries, keys, heads, kv_heads, qk_dim, v_dim", SHAPES, ids=SHAPE_IDS)
def test_suffix_attention_is_lower_right_causal(queries, keys, heads, kv_heads, qk_dim, v_dim, kernel, dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, queries, heads, qk_dim, generator=g)
    k = torch.randn(2, keys, kv_heads, qk_dim, generator=g)
    v = torch.randn(2, keys, kv_heads, v_dim, generator=g)
    weights = torch.randn(2, queries, heads, v_dim, generator=g, dtype=torch.float64)
    attention = causal_suffix_attention if kernel == "cpu" else suffix_attention._torch_suffix_attention
    got = _results(attention, q, k, v, weights, dtype)
    expected = _results(_reference, q, k, v, weights, torch.float64)
    for name, actual, wanted in zip(("out", "dq", "dk", "dv"), got, expected):
        torch.testing.assert_close(actual, wanted, rtol=0, atol=ATOL[dtype], msg=name)


def test_suffix_attention_on_meta_is_one_causal_kernel_of_the_chunk():
    """The dry run sizes the CUDA kernels: one causal SDPA call on the chunk's queries and the prefix's keys,
    output [batch, queries, heads, v_dim]."""
    q = torch.empty(2, 8, 4, 16, device="meta")
    k, v = torch.empty(2, 24, 2, 16, device="meta"), torch.empty(2, 24, 2, 8, device="meta")
    assert causal_suffix_attention(q, k, v).shape == (2, 8, 4, 8)
