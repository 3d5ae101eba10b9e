"""Attention kernels: SDPA with grouped-query attention against a written-out reference, and the
choice of flash-attn and the arguments of its call. flash-attn's kernel itself never runs here (it needs CUDA
and the package): a stand-in takes its place, so these tests do not make flash-attn a tested kernel."""

import math
import warnings
from collections.abc import Iterator

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


def test_causal_attention_passes_flash_attn_causal_and_deterministic_when_it_applies(monkeypatch):
    """The call's arguments only, through a stand-in that computes SDPA: not a test of flash-attn's kernel."""
    calls = []

    def fake_flash(q, k, v, causal, deterministic):
        calls.append(causal)
        assert deterministic == torch.are_deterministic_algorithms_enabled()
        return attention.sdpa(q, k, v, mask=None, is_causal=causal)

    monkeypatch.setattr(attention, "flash_attn_func", fake_flash)
    monkeypatch.setattr(attention, "flash_attention_applies", lambda device, dtype: True)
    q = k = v = torch.randn(1, 5, 2, 4)
    torch.testing.assert_close(attention.causal_attention(q, k, v), reference_causal_attention(q, k, v))
    assert calls == [True]


# Kernel choices on CUDA, decided here (the kernels themselves need CUDA) ----------------------------------


def test_sdpa_tries_cudnn_then_flash_then_efficient_then_math_on_cuda():
    priority = [backend.name for backend in attention.sdpa_backend_priority(torch.device("cuda"))]
    assert priority == ["CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"]


def test_sdpa_keeps_its_own_choice_off_cuda():
    assert attention.sdpa_backend_priority(torch.device("cpu")) is None


def test_sdpa_under_the_priority_context_compiles_in_one_graph(monkeypatch):
    """The CUDA path's `sdpa_kernel(priority)` context, run on CPU (whose kernel counts as flash): it must not
    break a block's fullgraph compile, and gives the reference result."""
    monkeypatch.setattr(attention, "sdpa_backend_priority", lambda device: attention.CUDA_SDPA_PRIORITY)
    q, k, v = torch.randn(2, 7, 4, 8), torch.randn(2, 7, 2, 8), torch.randn(2, 7, 2, 8)
    compiled = torch.compile(attention.sdpa, backend="eager", fullgraph=True)
    out = compiled(q, k, v, mask=None, is_causal=True)
    torch.testing.assert_close(out, reference_causal_attention(q, k, v), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "device, deterministic, expected", [("cuda", False, True), ("cuda", True, False), ("cpu", False, False)]
)
def test_flex_attention_autotunes_on_cuda_unless_deterministic(device, deterministic, expected):
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        assert attention.flex_max_autotune(torch.device(device)) is expected
    finally:
        torch.use_deterministic_algorithms(previous)


@pytest.mark.parametrize("max_autotune", [False, True])
def test_flex_compile_options_are_inductor_options(max_autotune):
    """torch.compile rejects unknown options only when it first compiles, which happens on CUDA alone."""
    options = attention.flex_compile_options(max_autotune)
    assert options.keys() <= torch._inductor.config.get_config_copy().keys()
    assert options.get("max_autotune", False) is max_autotune
    assert options["wrap_inductor_compiled_regions"]  # what lets per-op AC keep its output


# Document-causal attention ------------------------------------------------------------------------

# Row 0: three documents, the first a tail left from the previous row; row 1: one document.
DOCUMENT_IDS = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2], [0] * 11])
# Per document the same sums as SDPA over the whole row, minus masked terms that are exactly zero:
# fp32 reduction-order noise only.
DOCUMENT_ATOL = 1e-6
# The module's compiled flex_attention, before `eager_flex` swaps it out.
COMPILED_FLEX_ATTENTION = attention._compiled_flex_attention


def grouped_query_inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [2, 11, heads, 16] with 4 query heads sharing 2 key/value heads."""
    generator = torch.Generator().manual_seed(seed)
    bsz, seqlen = DOCUMENT_IDS.shape
    q = torch.randn(bsz, seqlen, 4, 16, generator=generator)
    k, v = torch.randn(2, bsz, seqlen, 2, 16, generator=generator)
    return q, k, v


def per_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor):
    """Causal attention run on each document of each row on its own, outputs put back in place."""
    out = torch.empty_like(q)
    for row, ids in enumerate(document_ids):
        for document in ids.unique():
            span = (ids == document).nonzero().flatten()
            part = slice(span[0].item(), span[-1].item() + 1)
            out[row : row + 1, part] = attention.causal_attention(
                q[row : row + 1, part], k[row : row + 1, part], v[row : row + 1, part]
            )
    return out


@pytest.fixture
def eager_flex(monkeypatch) -> Iterator[None]:
    """The CUDA path (flex_attention with a BlockMask) on CPU, through flex's eager reference
    implementation: checks our mask function and layout, not torch's compiled kernel."""
    monkeypatch.setattr(attention, "flex_attention_applies", lambda device: True)
    monkeypatch.setattr(attention, "_compiled_flex_attention", dict.fromkeys((False, True), attention.flex_attention))
    monkeypatch.setattr(attention, "_compiled_create_block_mask", attention.create_block_mask)
    with warnings.catch_warnings():  # "flex_attention called without torch.compile()": on purpose
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile", UserWarning)
        yield


@pytest.fixture(params=["sdpa", "flex"])
def kernel(request) -> str:
    if request.param == "flex":
        request.getfixturevalue("eager_flex")
    return request.param


def test_document_causal_attention_equals_attention_per_document(kernel):
    q, k, v = grouped_query_inputs()
    mask = attention.document_mask(DOCUMENT_IDS)
    assert isinstance(mask, attention.BlockMask) == (kernel == "flex")
    out = attention.document_causal_attention(q, k, v, mask)
    torch.testing.assert_close(out, per_document_attention(q, k, v, DOCUMENT_IDS), rtol=0, atol=DOCUMENT_ATOL)


def test_document_mask_hides_other_documents(kernel):
    q, k, v = grouped_query_inputs()
    other_q, other_k, other_v = grouped_query_inputs(seed=1)
    first_document = (DOCUMENT_IDS == 0)[:, :, None, None]
    # Replace everything outside row 0's first document: its outputs must not move.
    q2, k2, v2 = (torch.where(first_document, a, b) for a, b in ((q, other_q), (k, other_k), (v, other_v)))
    mask = attention.document_mask(DOCUMENT_IDS)
    before = attention.document_causal_attention(q, k, v, mask)
    after = attention.document_causal_attention(q2, k2, v2, mask)
    assert torch.equal(before[0, :3], after[0, :3])
    assert not torch.allclose(before[0, 3:], after[0, 3:])


def test_one_document_per_row_is_plain_causal_attention():
    q, k, v = grouped_query_inputs()
    one_document = torch.zeros_like(DOCUMENT_IDS)
    out = attention.document_causal_attention(q, k, v, attention.document_mask(one_document))
    torch.testing.assert_close(out, attention.causal_attention(q, k, v), rtol=0, atol=DOCUMENT_ATOL)


def test_flex_path_compiles_in_one_graph(eager_flex, monkeypatch):
    """A compiled block calls the compiled flex_attention chosen by `flex_max_autotune`: dynamo traces through
    that choice without a graph break (backend "eager": no kernel is generated)."""
    monkeypatch.setattr(attention, "_compiled_flex_attention", COMPILED_FLEX_ATTENTION)
    q, k, v = grouped_query_inputs()
    mask = attention.document_mask(DOCUMENT_IDS)
    compiled = torch.compile(attention.document_causal_attention, backend="eager", fullgraph=True)
    out = compiled(q, k, v, mask)
    torch.testing.assert_close(out, per_document_attention(q, k, v, DOCUMENT_IDS), rtol=0, atol=DOCUMENT_ATOL)
