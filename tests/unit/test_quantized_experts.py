"""quantize.experts: the routed experts' grouped matmuls in MXFP8 through torchao (emulated on CPU), their error
against high precision, which layers convert, what each rank's shapes must be (training: tests/integration/
test_quantize.py; layouts: tests/distributed/test_parallel_parity.py)."""

import copy
import dataclasses

import pytest
import torch

from torchpre.assembly.layout_checks import check_quantize_experts
from torchpre.distributed.parallel_dims import ParallelDims
from torchpre.errors import ConfigError
from torchpre.models.moe.args import MOE_FLAVORS
from torchpre.models.moe.model import GroupedExperts, MoETransformer
from torchpre.models.moe.parallelize import moe_expert_matmul_dims
from torchpre.parallel.quantized_experts import mxfp8_grouped_mm

pytest.importorskip("torchao")

COUNTS = [5, 40, 0, 19]  # groups of any size, an expert without tokens; one padding row after them


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value - reference).norm() / reference.norm()).item()


def forward_backward(experts: GroupedExperts, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
    tokens = tokens.clone().requires_grad_()
    out = experts(tokens, torch.tensor(COUNTS))
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    return out, tokens.grad, experts.w1.grad, experts.w2.grad, experts.w3.grad


# Measured relative errors of the SwiGLU of three MXFP8 matmuls against fp32 (seeds 0-2): output 6.5-6.7e-2, token
# gradient 6.1-6.6e-2, weight gradients 5.8-6.4e-2 with MXFP8 weight gradients (rowwise) and 4.7-5.3e-2 with them in
# high precision (bf16, from the MXFP8-rounded forward). MXFP8 keeps 3 mantissa bits (e4m3): a 1/16 rounding step per
# value, ~3.7% per matmul, compounded over the three. Held to [2e-2, 1.2e-1]; experts left in high precision (a
# grouped_mm never set) would be within 1e-6 of fp32, below the floor.
MX_BAND = (2e-2, 1.2e-1)


def test_mxfp8_experts_are_within_mxfp8_error_of_high_precision():
    """Forward and backward of converted experts against the same experts in fp32; the two recipes share the forward
    and the token gradient, and the weight gradients taken in high precision are the closer ones."""
    torch.manual_seed(0)
    reference = GroupedExperts(4, 64, 96)
    tokens = torch.randn(sum(COUNTS) + 1, 64)
    expected = forward_backward(reference, tokens)
    results = {}
    for recipe in ("rowwise", "rowwise_with_gw_hp"):
        experts = copy.deepcopy(reference)
        experts.grouped_mm = mxfp8_grouped_mm(emulate=True, wgrad_with_hp=recipe == "rowwise_with_gw_hp")
        results[recipe] = got = forward_backward(experts, tokens)
        errors = [relative_error(g[: sum(COUNTS)], e[: sum(COUNTS)]) for g, e in zip(got, expected)]
        assert all(MX_BAND[0] < e < MX_BAND[1] for e in errors), (recipe, errors)
        assert got[0][-1].abs().sum() == 0 and got[1][-1].abs().sum() == 0  # the padding row: zero out and gradient
    mx, hp = results["rowwise"], results["rowwise_with_gw_hp"]
    assert torch.equal(mx[0], hp[0]) and torch.equal(mx[1], hp[1])
    assert all(relative_error(h, e) < relative_error(m, e) for m, h, e in zip(mx[2:], hp[2:], expected[2:]))


def test_an_expert_s_weight_gradient_depends_on_its_own_tokens_only():
    """MXFP8 weight gradients (rowwise) scale blocks of 32 tokens: each expert's group is padded to whole blocks, so
    no scale is shared with another expert's tokens, whatever the group sizes (and under expert parallelism, whatever
    the other ranks send). Expert 0's 5 tokens would otherwise share a block with 27 of expert 1's."""
    torch.manual_seed(0)
    experts = GroupedExperts(4, 64, 96)
    experts.grouped_mm = mxfp8_grouped_mm(emulate=True, wgrad_with_hp=False)
    tokens = torch.randn(sum(COUNTS) + 1, 64)
    others = tokens.clone()
    others[COUNTS[0] :] *= 100  # every other expert's tokens, far larger
    grads = []
    for rows in (tokens, others):
        experts.zero_grad()
        forward_backward(experts, rows)
        grads.append([w.grad[0].clone() for w in (experts.w1, experts.w2, experts.w3)])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_every_moe_layer_converts_and_the_state_dict_stays_high_precision():
    args = dataclasses.replace(MOE_FLAVORS["debugmodel"], first_k_dense=1)
    with torch.device("meta"):
        model, plain = MoETransformer(args), MoETransformer(args)
    grouped_mm = mxfp8_grouped_mm(emulate=True, wgrad_with_hp=False)
    assert model.set_grouped_mm(grouped_mm) == args.n_layers - 1
    assert [m.experts.grouped_mm for m in model.moe_layers()] == [grouped_mm] * (args.n_layers - 1)
    shapes = lambda m: {k: (v.shape, v.dtype, type(v)) for k, v in m.state_dict().items()}  # noqa: E731
    assert shapes(model) == shapes(plain)


def test_each_rank_s_expert_dimensions_are_checked():
    args = MOE_FLAVORS["tiny"]  # dim 32, experts' hidden 32

    def check(tp: int, ep: int) -> None:
        dims = ParallelDims(dp=ep, tp=tp, pp=1, world_size=ep * tp, ep=ep)  # ep is carved out of dp
        check_quantize_experts("mxfp8", "moe", moe_expert_matmul_dims(args, dims))

    check(tp=1, ep=1)
    check(tp=2, ep=2)  # expert parallelism places the experts whole: tp does not slice them
    with pytest.raises(ConfigError, match=r"moe_hidden_dim / parallelism.tensor_parallel_degree = 16.*multiples of 32"):
        check(tp=2, ep=1)
    with pytest.raises(ConfigError, match="model.name = 'llama3': that family has no routed experts whose"):
        check_quantize_experts("mxfp8", "llama3", None)
    with pytest.raises(ConfigError, match="quantize.linear = 'float8'.*no emulation"):
        check_quantize_experts("float8", "moe", {"dim": 32})
    with pytest.raises(ConfigError, match="quantize.linear = 'none'.*Set quantize.linear = 'mxfp8'"):
        check_quantize_experts("none", "moe", {"dim": 32})


def test_on_the_meta_device_the_experts_give_the_shapes_of_a_grouped_matmul():
    """The dry run (meta tensors, no values to scale) plans the converted experts as bf16 grouped matmuls."""
    with torch.device("meta"):
        experts = GroupedExperts(4, 64, 96)
        tokens = torch.empty(sum(COUNTS), 64)
    experts.grouped_mm = mxfp8_grouped_mm(emulate=False, wgrad_with_hp=False)  # a dry run plans for the GPU's kernels
    out = experts(tokens, torch.tensor(COUNTS, device="meta"))
    assert (out.shape, out.dtype, out.device.type) == ((sum(COUNTS), 64), torch.float32, "meta")
