"""Blockwise masked attention computes SDPA's masked attention, output and q/k/v gradients, a block of queries at a
time: grouped-query heads, queries at scattered positions (a head-tail shard), a shared [queries, keys] mask and a
per-row [batch, 1, queries, keys] one, blocks that do not divide the queries, values of another head size than the
queries' (multi-head latent attention). The oracle is SDPA in float64."""

import pytest
import torch
import torch.nn.functional as F

from torchpre.models import blockwise_attention
from torchpre.models.blockwise_attention import blockwise_masked_attention

# fp32 against float64: measured within 7e-7 on outputs and gradients of magnitude up to 3 (SDPA's own fp32 math
# kernel is within 2.4e-6 of float64 on the same inputs).
ATOL = 1e-6


def _sdpa(q, k, v, mask):
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True
    )
    return out.transpose(1, 2)


@pytest.mark.parametrize("per_row", [False, True], ids=["shared_mask", "per_row_mask"])
@pytest.mark.parametrize(
    "queries, keys, heads, kv_heads, block, v_dim", [(40, 64, 4, 2, 16, 8), (33, 70, 6, 2, 8, 12), (8, 8, 2, 2, 256, 8)]
)
def test_blockwise_attention_is_sdpas(monkeypatch, queries, keys, heads, kv_heads, block, v_dim, per_row):
    monkeypatch.setattr(blockwise_attention, "MIN_ROWS", 1)
    monkeypatch.setattr(blockwise_attention, "BLOCK_ELEMENTS", 2 * heads * keys * block)  # `block` queries
    g = torch.Generator().manual_seed(0)
    shapes = ((queries, heads, 8), (keys, kv_heads, 8), (keys, kv_heads, v_dim))
    q, k, v = (torch.randn(2, n, h, d, generator=g) for n, h, d in shapes)
    positions = torch.randperm(keys, generator=g)[:queries]
    mask = positions[:, None] >= torch.arange(keys)[None, :]
    if per_row:  # documents: some keys cut off, each query still sees itself
        mask = (mask & (torch.rand(2, 1, queries, keys, generator=g) > 0.3)) | (
            positions[:, None] == torch.arange(keys)
        )
    weights = torch.randn(2, queries, heads, v_dim, generator=g)
    results = []
    for attention, dtype in ((blockwise_masked_attention, torch.float32), (_sdpa, torch.float64)):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = attention(*leaves, mask)
        (out * weights.to(dtype)).sum().backward()
        results.append([out.detach().double(), *(t.grad.double() for t in leaves)])
    for name, got, expected in zip(("out", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(got, expected, rtol=0, atol=ATOL, msg=name)
