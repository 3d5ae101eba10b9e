"""µP and CompleteP against hand computations, on the tiny flavor as the base (dim 64, 4 heads of 16, SwiGLU 192 wide,
2 layers): the optimizer's per-parameter learning rates, weight decays and eps at two widths, the init they draw, the
attention scale, the residual multipliers, and the shape keys."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchpre.assembly.args import model_args
from torchpre.assembly.parametrization import optimizer_scales
from torchpre.config.job_config import JobConfig
from torchpre.config.parser import parse_args
from torchpre.data.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer
from torchpre.errors import ConfigError
from torchpre.models.llama3.model import apply_rope
from torchpre.models.parametrization import fold_multipliers
from torchpre.models.registry import get_model_spec
from torchpre.optim import build_optimizer
from torchpre.parallel import ParallelPlan, parallelize

TOKENIZER = load_tokenizer(DEFAULT_TOKENIZER_PATH)
SEED, LR, WEIGHT_DECAY, EPS = 3, 1e-3, 0.1, 1e-8
# The tiny flavor's SwiGLU width at each dim: 32 x ceil(int(8 x dim / 3) / 32).
FFN = {64: 192, 128: 352, 256: 704}
HIDDEN = ("wq", "wk", "wv", "wo", "w1", "w3")


def args_of(*flags: str):
    return model_args(parse_args(JobConfig, ["--model.flavor", "tiny", *flags]), TOKENIZER)


def build(mesh, args) -> nn.Module:
    """The model of `args` in one process, initialised from SEED."""
    with torch.device("meta"):
        model = get_model_spec("llama3").build.model_cls(args)
    return parallelize(model, mesh, ParallelPlan(blocks="layers"), device=torch.device("cpu"), init_weights=_init)


def _init(module: nn.Module) -> None:
    module.init_weights(SEED)


def lr_factor(name: str, dim: int) -> float:
    """µP's learning-rate factor for Adam-like optimizers, by hand: 1 / (fan-in / the base's fan-in) for the hidden
    matrices (w2's fan-in is the SwiGLU width), 1 for the embedding, the output layer and the norms."""
    if name.endswith("w2.weight"):
        return FFN[64] / FFN[dim]
    return 64 / dim if any(f".{part}." in name for part in HIDDEN) else 1.0


def init_factor(name: str, dim: int) -> float:
    """µP's init std factor by hand: 1 / sqrt(fan-in ratio) for the hidden matrices, 1 for the rest."""
    return lr_factor(name, dim) ** 0.5


@pytest.mark.parametrize("dim", [128, 256])
def test_lr_groups_and_init_std_of_a_mup_model_are_the_closed_form(mesh, dim):
    args = args_of("--model.dim", str(dim), "--model.parametrization", "mup")
    model = build(mesh, args)
    optimizer = build_optimizer(
        model, name="AdamW", lr=LR, weight_decay=WEIGHT_DECAY, eps=EPS, scales=optimizer_scales(args, "AdamW")
    )
    seen = set()
    for group in optimizer.inner.param_groups:
        for name, param in zip(group["names"], group["params"]):
            factor = lr_factor(name, dim)
            # rel 1e-12: the same ratios, rounded in another order
            assert group["lr"] == pytest.approx(LR * factor, rel=1e-12), name
            decay = WEIGHT_DECAY / factor if param.ndim >= 2 else 0.0  # lr x decay per step is the base's
            assert group["weight_decay"] == pytest.approx(decay, rel=1e-12), name
            assert group["eps"] == EPS, name
            seen.add(name)
    assert seen == {name for name, _ in model.named_parameters()}

    standard = dict(build(mesh, args_of("--model.dim", str(dim))).named_parameters())
    for name, param in model.named_parameters():  # the standard init's draw (same generator), times the factor
        if name != "output.weight":
            assert torch.equal(param, standard[name] * init_factor(name, dim)), name
    # The standard output layer's std is dim^-0.5; µP keeps the base's, 64^-0.5: the same draw, the stds' rounding.
    output = dict(model.named_parameters())["output.weight"]
    torch.testing.assert_close(output, standard["output.weight"] * (dim / 64) ** 0.5, rtol=1e-6, atol=0)
    params = dict(model.named_parameters())
    # std of >= 8k draws: sampling error < 0.8%; the output layer's normal is cut at 3 std (1.3% lower): held to 3%.
    assert params["layers.0.attention.wq.weight"].std().item() == pytest.approx(0.02 * (64 / dim) ** 0.5, rel=0.03)
    assert params["output.weight"].std().item() == pytest.approx(64**-0.5, rel=0.03)  # the base's: width-free
    assert params["tok_embeddings.weight"].std().item() == pytest.approx(1.0, rel=0.03)


@pytest.mark.parametrize("dim", [128, 256])
def test_attention_scale_is_one_over_head_dim_and_logits_shrink_with_width(mesh, dim):
    """The softmax scale is sqrt(base head dim 16) / head dim (1/sqrt(head dim) at the base), checked against attention
    written out; the logits are the output layer's times base / width."""
    args = args_of("--model.dim", str(dim), "--model.parametrization", "mup")
    assert args.parametrization.logit_multiplier == 64 / dim
    model = build(mesh, args).parts[0]
    attention, head_dim = model.layers["0"].attention, dim // 4
    x = torch.randn(2, 8, dim, generator=torch.Generator().manual_seed(0))
    rope = model.rope_cache[:8]
    q = apply_rope(attention.wq(x).view(2, 8, 4, head_dim), rope).transpose(1, 2)
    k = apply_rope(attention.wk(x).view(2, 8, 2, head_dim), rope).transpose(1, 2).repeat_interleave(2, dim=1)
    v = attention.wv(x).view(2, 8, 2, head_dim).transpose(1, 2).repeat_interleave(2, dim=1)
    scores = q @ k.transpose(-1, -2) * (16**0.5 / head_dim)
    scores = scores.masked_fill(~torch.ones(8, 8, dtype=torch.bool).tril(), float("-inf"))
    expected = attention.wo((F.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(2, 8, dim))
    # fp32, a fused kernel against the written-out sums: reduction order only (measured < 1e-7)
    torch.testing.assert_close(attention(x, model.rope_cache), expected, rtol=0, atol=1e-6)
    h = torch.randn(2, 8, dim, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(model.logits(h), model.output(h) * (64 / dim), rtol=0, atol=0)


def test_complete_p_scales_residual_branches_eps_and_initialises_by_relative_depth(mesh):
    """Width 128 (x2) and depth 4 over the base's 2: residual branches x 2/4, eps / (2 x 2), and block 3 drawn as the
    base's block 3 x 2 // 4 = 1 (torchtitan's std 0.02 / sqrt(2 (layer + 1)) shrinks with the layer index)."""
    args = args_of("--model.dim", "128", "--model.n_layers", "4", "--model.parametrization", "complete_p")
    model = build(mesh, args)
    assert [block.residual_multiplier for block in model.parts[0].layers.values()] == [0.5] * 4
    optimizer = build_optimizer(model, name="AdamW", lr=LR, eps=EPS, scales=optimizer_scales(args, "AdamW"))
    assert {group["eps"] for group in optimizer.inner.param_groups} == {EPS / 4}
    wo = dict(model.named_parameters())["layers.3.attention.wo.weight"]
    # std of 16k draws: sampling error 0.6%; the relative-depth std (0.00707) and the layer index's (0.005) differ 41%
    assert wo.std().item() == pytest.approx(0.02 / math.sqrt(2 * 2) * 0.5**0.5, rel=0.03)


def test_sgd_factors_are_the_mup_packages_musgd(mesh):
    """SGD at width 128: lr x m for the embedding, output and norms (one dimension grows), x fan-out ratio / fan-in
    ratio for the hidden matrices."""
    args = args_of("--model.dim", "128", "--model.parametrization", "mup")
    factors = optimizer_scales(args, "SGD").factors
    assert factors("tok_embeddings.weight", (2048, 128))[0] == 2.0
    assert factors("layers.0.ffn_norm.weight", (128,))[0] == 2.0
    assert factors("layers.0.attention.wq.weight", (128, 128))[0] == 1.0
    assert factors("layers.1.feed_forward.w1.weight", (352, 128)) == pytest.approx((352 / 192 / 2, 2 / (352 / 192), 1))
    assert factors("layers.1.feed_forward.w2.weight", (128, 352)) == pytest.approx((2 / (352 / 192), 352 / 192 / 2, 1))


def test_mup_at_the_base_shape_is_the_standard_model(mesh):
    """At the base shape every factor and multiplier is 1: the same weights, buffers and logits as the standard
    parametrization, and no extra buffers for the dry run or the planner to count."""
    standard = build(mesh, args_of()).parts[0]
    mup = build(mesh, args_of("--model.parametrization", "mup")).parts[0]
    buffers = [(name, b.shape, b.dtype) for name, b in standard.named_buffers()]
    assert [(name, b.shape, b.dtype) for name, b in mup.named_buffers()] == buffers
    assert all(torch.equal(a, b) for a, b in zip(mup.parameters(), standard.parameters(), strict=True))
    tokens = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(mup(tokens), standard(tokens))


def test_shape_keys_scale_the_widths_that_follow_dim():
    moe = model_args(parse_args(JobConfig, ["--model.name", "moe", "--model.flavor", "tiny", "--model.dim", "64"]),
                     TOKENIZER)  # fmt: skip
    assert (moe.dim, moe.moe_hidden_dim, moe.shared_expert_hidden_dim) == (64, 64, 64)  # 32 each in the flavor
    flags = ["--model.name", "deepseek_v3", "--model.dim", "128", "--model.n_layers", "4", "--model.n_heads", "8"]
    dsv3 = model_args(parse_args(JobConfig, flags), TOKENIZER)
    widths = (dsv3.q_lora_rank, dsv3.kv_lora_rank, dsv3.dense_hidden_dim, dsv3.moe_hidden_dim)
    assert (dsv3.n_layers, dsv3.n_heads, *widths) == (4, 8, 64, 64, 256, 64)  # the flavor's x 2; head sizes kept
    llama = args_of("--model.dim", "128", "--model.n_heads", "8", "--model.n_kv_heads", "4")
    assert (llama.head_dim, llama.n_kv_heads, llama.ffn_hidden_dim) == (16, 4, 352)


def test_tied_embedding_and_logit_multipliers_that_differ_do_not_fold():
    """An architecture without multipliers gets them folded into the weights; one matrix serving both ends takes one
    factor only, so differing embedding and logit multipliers are refused by name, equal ones fold."""
    parametrization = args_of("--model.dim", "128", "--model.parametrization", "mup").parametrization
    state = {"tok_embeddings.weight": torch.ones(2), "output.weight": torch.ones(2)}
    weights = {"embedding": ("tok_embeddings.weight",), "logits": ("output.weight",)}
    with pytest.raises(ConfigError, match="embedding multiplier 1 and the logit multiplier 0.5 differ"):
        fold_multipliers(state, parametrization, weights, tied=True)
    folded = fold_multipliers(state, parametrization, weights, tied=False)
    assert folded["tok_embeddings.weight"].tolist() == [1, 1] and folded["output.weight"].tolist() == [0.5, 0.5]
    same = dataclasses.replace(parametrization, embedding_multiplier=0.5)
    assert fold_multipliers(state, same, weights, tied=True)["tok_embeddings.weight"].tolist() == [0.5, 0.5]
