"""Attention kernels: SDPA with grouped-query attention against a written-out reference, and the
choice of flash-attn."""

import math

import pytest
import torch

from torchpre.models import attention


def reference_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + causal mask) v with each key/value head repeated for its query heads."""
    repeat = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    seq = q.shape[1]
    scores = scores.masked_fill(~torch.ones(seq, seq, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


def test_causal_attention_with_grouped_query_heads_matches_reference():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 7, 4, 8), torch.randn(2, 7, 2, 8), torch.randn(2, 7, 2, 8)
    out = attention.causal_attention(q, k, v)
    assert out.shape == q.shape
    torch.testing.assert_close(out, reference_causal_attention(q, k, v), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "installed, device, dtype, expected",
    [
        (True, "cuda", torch.bfloat16, True),
        (True, "cuda", torch.float16, True),
        (True, "cuda", torch.float32, False),
        (True, "cpu", torch.bfloat16, False),
        (False, "cuda", torch.bfloat16, False),
    ],
)
def test_flash_attention_only_for_half_precision_cuda_when_installed(monkeypatch, installed, device, dtype, expected):
    monkeypatch.setattr(attention, "flash_attn_func", (lambda *a, **k: None) if installed else None)
    assert attention.flash_attention_applies(torch.device(device), dtype) is expected


def test_causal_attention_calls_flash_attn_causally_when_it_applies(monkeypatch):
    calls = []

    def fake_flash(q, k, v, causal):
        calls.append(causal)
        return attention.sdpa(q, k, v, mask=None, is_causal=causal)

    monkeypatch.setattr(attention, "flash_attn_func", fake_flash)
    monkeypatch.setattr(attention, "flash_attention_applies", lambda device, dtype: True)
    q = k = v = torch.randn(1, 5, 2, 4)
    torch.testing.assert_close(attention.causal_attention(q, k, v), reference_causal_attention(q, k, v))
    assert calls == [True]
