"""Llama 3 model: shapes, causality, RoPE, GQA, flavors and layout-independent init."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from torchpre.errors import ConfigError
from torchpre.models.init import init_parameters, local_part, shard_slices
from torchpre.models.llama3.args import (
    LLAMA3_FLAVORS,
    RopeScaling,
    TransformerArgs,
    flops_per_token,
)
from torchpre.models.llama3.model import (
    Attention,
    Transformer,
    apply_rope,
    build_rope_cache,
    init_rule,
    precompute_rope,
)

ARGS = TransformerArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=16)
SEQ = 16


def build(args: TransformerArgs = ARGS, seed: int = 0) -> Transformer:
    """The production path: meta build, materialize, seeded init."""
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model


def tokens(batch: int = 2, seq: int = SEQ) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, ARGS.vocab_size, (batch, seq), generator=generator)


def assert_params_equal(a: torch.nn.Module, b: torch.nn.Module, names: list[str]) -> None:
    sa, sb = a.state_dict(), b.state_dict()  # state_dict lists a tied parameter under both names
    for name in names:
        assert torch.equal(sa[name], sb[name]), name


def test_logits_shape_and_dtype() -> None:
    model = build()
    assert model(tokens()).shape == (2, SEQ, ARGS.vocab_size)
    assert model.to(torch.bfloat16)(tokens()).dtype == torch.bfloat16


def test_sequence_longer_than_max_seq_len_is_rejected() -> None:
    with pytest.raises(ValueError, match="max_seq_len"):
        build()(tokens(seq=SEQ + 1))


def test_causal() -> None:
    model = build()
    x = tokens()
    changed = x.clone()
    changed[:, 10] = (changed[:, 10] + 1) % ARGS.vocab_size
    before, after = model(x), model(changed)
    assert torch.equal(before[:, :10], after[:, :10])
    assert not torch.allclose(before[:, 10:], after[:, 10:])


def test_rope_matches_per_position_rotation() -> None:
    head_dim, theta = 8, 10000.0
    x = torch.randn(1, SEQ, 3, head_dim, dtype=torch.float64)
    expected = torch.empty_like(x)
    for pos in range(SEQ):
        for i in range(head_dim // 2):
            angle = pos * theta ** (-2 * i / head_dim)
            a, b = x[..., pos, :, 2 * i], x[..., pos, :, 2 * i + 1]
            expected[..., pos, :, 2 * i] = a * math.cos(angle) - b * math.sin(angle)
            expected[..., pos, :, 2 * i + 1] = a * math.sin(angle) + b * math.cos(angle)
    cache = build_rope_cache(*precompute_rope(head_dim, SEQ, theta))
    out = apply_rope(x.float(), cache)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def meta_apply_scaling(freqs: list[float], s: RopeScaling) -> list[float]:
    """Meta's Llama 3.1 `apply_scaling`, written out per frequency."""
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            out.append(freq)
        elif wavelen > low_freq_wavelen:
            out.append(freq / s.factor)
        else:
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor
            )
            out.append((1 - smooth) * freq / s.factor + smooth * freq)
    return out


def test_rope_llama31_scaling_matches_meta() -> None:
    head_dim, theta, seq = 128, 500000.0, 64
    scaling = LLAMA3_FLAVORS["8B"].rope_scaling
    base = [theta ** (-i / head_dim) for i in range(0, head_dim, 2)]
    scaled = meta_apply_scaling(base, scaling)
    kept = sum(s == b for s, b in zip(scaled, base))
    divided = sum(math.isclose(s, b / scaling.factor) for s, b in zip(scaled, base))
    assert kept and divided and kept + divided < len(base), "all three regimes are exercised"
    positions = torch.arange(seq, dtype=torch.float64)
    angles = torch.outer(positions, torch.tensor(scaled, dtype=torch.float64))
    cos, sin = precompute_rope(head_dim, seq, theta, scaling)
    torch.testing.assert_close(cos.double(), angles.cos(), atol=2e-5, rtol=0)
    torch.testing.assert_close(sin.double(), angles.sin(), atol=2e-5, rtol=0)


def test_gqa_matches_repeat_kv_reference() -> None:
    torch.manual_seed(0)
    attn = Attention(dim=64, n_heads=4, n_kv_heads=2)
    x = torch.randn(2, SEQ, 64)
    cache = build_rope_cache(*precompute_rope(16, SEQ, 10000.0))

    q = apply_rope(attn.wq(x).view(2, SEQ, 4, 16), cache).transpose(1, 2)
    k = apply_rope(attn.wk(x).view(2, SEQ, 2, 16), cache).transpose(1, 2)
    v = attn.wv(x).view(2, SEQ, 2, 16).transpose(1, 2)
    # Query head h attends with kv head h // 2, as in Meta's repeat_kv.
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(16)
    future = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)
    weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    expected = attn.wo((weights @ v).transpose(1, 2).reshape(2, SEQ, 64))

    torch.testing.assert_close(attn(x, cache), expected, atol=1e-5, rtol=1e-5)


def test_init_is_deterministic_and_seed_dependent() -> None:
    a, b, other = build(seed=0), build(seed=0), build(seed=1)
    names = [name for name, _ in a.named_parameters()]
    assert_params_equal(a, b, names)
    assert not torch.equal(a.tok_embeddings.weight, other.tok_embeddings.weight)
    assert torch.equal(a.rope_cache, Transformer(ARGS).rope_cache)


def test_init_std_follows_rule() -> None:
    model = build(dataclasses.replace(ARGS, dim=256, n_heads=8, n_kv_heads=4, vocab_size=2048))
    assert model.tok_embeddings.weight.std().item() == pytest.approx(1.0, rel=0.02)
    assert torch.equal(model.norm.weight, torch.ones(256))
    assert model.layers["0"].attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.layers["1"].feed_forward.w2.weight.std().item() == pytest.approx(0.01, rel=0.05)
    out = model.output.weight
    assert out.abs().max().item() <= 3 * 256**-0.5


def test_adding_layers_keeps_existing_init() -> None:
    two, three = build(), build(dataclasses.replace(ARGS, n_layers=3))
    assert_params_equal(two, three, [name for name, _ in two.named_parameters()])


def test_init_ignores_wrappers_in_names() -> None:
    with torch.device("meta"):
        model = Transformer(ARGS)
    for key, block in model.layers.items():
        model.layers[key] = checkpoint_wrapper(block)
    model.to_empty(device="cpu")
    model.init_weights(0)
    reference = build()
    for (_, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert torch.equal(p, q)


def test_init_rejects_unknown_and_unmaterialized_parameters() -> None:
    with pytest.raises(KeyError, match="layers.0.attention.bias"):
        init_rule(ARGS)("layers.0.attention.bias")
    with torch.device("meta"):
        model = Transformer(ARGS)
    with pytest.raises(RuntimeError, match="to_empty"):
        init_parameters(model, 0, init_rule(ARGS))


def test_shard_slices_reassemble_the_full_tensor() -> None:
    full = torch.randn(6, 4)
    assert local_part(full, torch.empty(6, 4)) is full
    # 2-way Shard(0) and Shard(1) as compute_local_shape_and_global_offset reports them.
    rows = [full[shard_slices((3, 4), (offset, 0))] for offset in (0, 3)]
    cols = [full[shard_slices((6, 2), (0, offset))] for offset in (0, 2)]
    assert torch.equal(torch.cat(rows, dim=0), full)
    assert torch.equal(torch.cat(cols, dim=1), full)


def _tensor_parallel_rank(rank: int, store_path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        with torch.device("meta"):
            model = Transformer(ARGS)
        parallelize_module(model, mesh, {"output": ColwiseParallel(use_local_output=False)})
        block_plan = {
            **dict.fromkeys(["attention.wq", "attention.wk", "attention.wv"], ColwiseParallel()),
            **dict.fromkeys(["feed_forward.w1", "feed_forward.w3"], ColwiseParallel()),
            **dict.fromkeys(["attention.wo", "feed_forward.w2"], RowwiseParallel()),
        }
        for block in model.layers.values():
            parallelize_module(block, mesh, block_plan)
        model.to_empty(device="cpu")
        model.init_weights(0)

        reference = build()
        expected = dict(reference.named_parameters())
        for name, param in model.named_parameters():
            if isinstance(param, DTensor):
                shard = expected[name].chunk(2, dim=param.placements[0].dim)[rank]
                assert torch.equal(param.to_local(), shard), name
            else:
                assert torch.equal(param, expected[name]), name
        # fp32 on CPU: the row-parallel all-reduce only changes summation order.
        torch.testing.assert_close(model(tokens()).full_tensor(), reference(tokens()))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_tensor_parallel_init_equals_single_process(tmp_path) -> None:
    mp.spawn(_tensor_parallel_rank, args=(str(tmp_path / "store"),), nprocs=2)


def test_tied_embeddings_share_one_parameter() -> None:
    args = dataclasses.replace(ARGS, tie_word_embeddings=True)
    model = build(args)
    assert model.output.weight is model.tok_embeddings.weight
    assert [name for name, _ in model.named_parameters()].count("output.weight") == 0
    assert model.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.1)


def split_stages(model: Transformer) -> tuple[Transformer, Transformer]:
    """Two pipeline stages the way a splitter makes them: deep copies with parts removed."""
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    del first.layers["1"]
    first.norm, first.output = None, None
    del last.layers["0"]
    last.tok_embeddings = None
    return first, last


def test_pipeline_stages_of_a_tied_model_start_equal() -> None:
    args = dataclasses.replace(ARGS, tie_word_embeddings=True)
    with torch.device("meta"):
        first, last = split_stages(Transformer(args))
    for stage in (first, last):
        stage.to_empty(device="cpu")
        stage.init_weights(0)
    full = build(args)
    assert torch.equal(last.output.weight, first.tok_embeddings.weight)
    assert_params_equal(first, full, [name for name, _ in first.named_parameters()])
    assert_params_equal(last, full, [name for name, _ in last.named_parameters()])


def test_pipeline_stages_compose_to_the_full_model() -> None:
    model = build()
    first, last = split_stages(model)
    hidden = first(tokens())
    assert hidden.shape == (2, SEQ, ARGS.dim)
    torch.testing.assert_close(last(hidden), model(tokens()), atol=0, rtol=0)


@pytest.mark.parametrize(
    ("flavor", "expected"), [("1B", 1.24e9), ("8B", 8.03e9), ("70B", 70.55e9), ("405B", 405.9e9)]
)
def test_flavor_parameter_counts(flavor: str, expected: float) -> None:
    with torch.device("meta"):
        model = Transformer(LLAMA3_FLAVORS[flavor])
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(expected, rel=0.01)


def test_ffn_hidden_dims_match_released_models() -> None:
    dims = {name: LLAMA3_FLAVORS[name].ffn_hidden_dim for name in ("1B", "3B", "8B", "70B", "405B")}
    assert dims == {"1B": 8192, "3B": 8192, "8B": 14336, "70B": 28672, "405B": 53248}


def test_flops_per_token_counts_output_but_not_lookup() -> None:
    untied = ARGS
    tied = dataclasses.replace(ARGS, tie_word_embeddings=True)
    table = ARGS.vocab_size * ARGS.dim
    attention = 12 * ARGS.n_layers * ARGS.dim * SEQ
    body = 1000
    assert flops_per_token(untied, body + 2 * table, SEQ) == 6 * (body + table) + attention
    assert flops_per_token(tied, body + table, SEQ) == 6 * (body + table) + attention


def test_args_validation() -> None:
    assert TransformerArgs(dim=64, n_layers=1, n_heads=4).n_kv_heads == 4
    with pytest.raises(ConfigError, match="n_kv_heads"):
        TransformerArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=3)
    with pytest.raises(ConfigError, match="n_heads"):
        TransformerArgs(dim=64, n_layers=1, n_heads=5)
