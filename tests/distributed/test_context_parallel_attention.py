"""Context-parallel attention alone equals one process: each cp rank holds its head-tail positions of q, k and v,
gathers the keys and values, and its output rows and q/k/v gradients match the whole sequence's causal (and
document-causal) attention at those positions, under cp2 and cp4, with grouped-query heads; and the tokens ahead
of each position (multi-token prediction) are the whole row's."""

import functools
from pathlib import Path

import pytest
import torch

from tests.launch import spawn
from torchpre.models.attention import causal_attention, document_causal_attention, document_mask
from torchpre.parallel.context_parallel import ContextParallel
from torchpre.parallel.forward_inputs import future_tokens
from torchpre.training.job import CONTEXT_PARALLEL_KERNELS

pytestmark = pytest.mark.slow

BATCH, SEQ, HEADS, KV_HEADS, HEAD_DIM = 2, 32, 4, 2, 8
BOS = 7
# fp32 on CPU: the gathered attention computes each output row from the same keys as one process, through other
# kernels (causal: the CPU flash kernel over the prefix and over the chunk, merged; documents: the blockwise masked
# kernel), another summation order: outputs within 6.0e-7, dq within 9.5e-7 on entries up to 2.2 (measured, cp2 and
# cp4, with and without documents). The gradients of k and v are sums over every query, which the cp ranks add as
# partial sums in another order: measured up to 1.9e-6 on dv entries of magnitude up to 4.7 (fp32 spacing at 4 is
# 4.8e-7). So 1e-6 relative to the largest entry of each tensor (at least 1). A wrong position or mask offset moves
# rows by O(0.1).
RTOL_OF_MAX = 1e-6
TOKENS_AHEAD = 3


def inputs() -> tuple[torch.Tensor, ...]:
    """q, k, v of the whole sequence, and tokens with BOS at fixed places (three documents per row, the first begun
    before the row), the same on every rank."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(BATCH, SEQ, HEADS, HEAD_DIM, generator=g)
    k = torch.randn(BATCH, SEQ, KV_HEADS, HEAD_DIM, generator=g)
    v = torch.randn(BATCH, SEQ, KV_HEADS, HEAD_DIM, generator=g)
    tokens = torch.randint(8, 100, (BATCH, SEQ), generator=g)
    tokens[0, [5, 17]] = BOS
    tokens[1, [9, 10, 30]] = BOS
    return q, k, v, tokens


def reference(documents: bool) -> tuple[torch.Tensor, ...]:
    """Output and q/k/v gradients of one process over the whole sequence, for the loss sum(out * weights)."""
    q, k, v, tokens = inputs()
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    if documents:
        out = document_causal_attention(q, k, v, document_mask((tokens == BOS).cumsum(dim=1)))
    else:
        out = causal_attention(q, k, v)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * weights).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad, weights


def _check(documents: bool, mesh) -> None:
    out_ref, dq_ref, dk_ref, dv_ref, weights = reference(documents)
    cp = ContextParallel(
        mesh, SEQ, torch.device("cpu"), CONTEXT_PARALLEL_KERNELS, document_bos=BOS if documents else None,
        tokens_ahead=TOKENS_AHEAD,
    )
    q, k, v, tokens = inputs()
    local = [t.index_select(1, cp.positions).clone().requires_grad_() for t in (q, k, v)]
    kwargs = cp.forward_kwargs(tokens.index_select(1, cp.positions))
    assert kwargs.keys() == ({"document_ids", "future_tokens"} if documents else {"future_tokens"})
    # Multi-token prediction's tokens ahead of each position: those of the whole row, another rank's included.
    assert torch.equal(kwargs["future_tokens"], future_tokens(tokens, TOKENS_AHEAD)[:, cp.positions])
    attend = cp.document_attention(kwargs["document_ids"]) if documents else cp.attend
    out = attend(*local)
    (out * weights.index_select(1, cp.positions)).sum().backward()
    pos = cp.positions
    _assert_close(out.detach(), out_ref[:, pos], "output")
    for name, tensor, grad_ref in zip("qkv", local, (dq_ref, dk_ref, dv_ref)):
        _assert_close(tensor.grad, grad_ref[:, pos], f"d{name}")


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    atol = RTOL_OF_MAX * max(1.0, expected.abs().max().item())
    torch.testing.assert_close(actual, expected, rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "document_mask"])
@pytest.mark.parametrize("cp", [2, 4])
def test_attention_alone_matches_one_process(cp, documents, tmp_path: Path):
    spawn(functools.partial(_check, documents), cp, tmp_path / "store")
