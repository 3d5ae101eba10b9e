"""MoE model: routed experts against a per-token reference, the load-balancing loss and its gradient,
router statistics, init, the whole model, and the Mixtral parameter and FLOP counts.

Tolerances: everything is float32 on CPU, so differences are reduction-order noise only; 1e-5 absolute on
outputs of size ~1 and 1e-6 relative-ish on gradients, far below any real bug (a wrong expert, weight or
missing aux term changes values at 1e-2 or more).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from torchpre.errors import ConfigError
from torchpre.models.moe.args import MOE_FLAVORS, MoEArgs, active_params, flops_per_token
from torchpre.models.moe.model import GroupedExperts, MoE, MoETransformer, init_rule

TINY = dataclasses.replace(MOE_FLAVORS["tiny"], vocab_size=128, max_seq_len=32)
BATCH, SEQ = 4, 8


def build(args: MoEArgs = TINY, seed: int = 0) -> MoETransformer:
    """The production path: meta build, materialize, seeded init."""
    with torch.device("meta"):
        model = MoETransformer(args)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model


def make_moe(args: MoEArgs = TINY, seed: int = 0) -> MoE:
    """A standalone MoE with weights of std 0.3, so routing is far from uniform and every term matters."""
    moe = MoE(args)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in moe.parameters():
            param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    return moe


def inputs(batch: int = BATCH, seq: int = SEQ, dim: int = TINY.dim, seed: int = 1) -> Tensor:
    return torch.randn(batch, seq, dim, generator=torch.Generator().manual_seed(seed))


def swiglu(x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor) -> Tensor:
    return (F.silu(x @ w1) * (x @ w3)) @ w2


def reference_moe(moe: MoE, x: Tensor) -> Tensor:
    """One token at a time: sum over its top-k experts of weight * expert(token), plus the shared expert."""
    experts, out = moe.experts, torch.zeros_like(x)
    for b in range(x.shape[0]):
        for s in range(x.shape[1]):
            token = x[b, s]
            probs = torch.softmax(moe.router.weight @ token, dim=-1)
            top = probs.topk(moe.top_k)
            weights = top.values / top.values.sum() if moe.routing.norm_topk_prob else top.values
            for weight, e in zip(weights, top.indices.tolist()):
                out[b, s] += weight * swiglu(token, experts.w1[e], experts.w2[e], experts.w3[e])
            if moe.shared_expert is not None:
                out[b, s] += moe.shared_expert(token)
    return out


def reference_aux(moe: MoE, x: Tensor) -> Tensor:
    """sum_b aux_b, written out with loops: aux_b = E * sum_e (count_be / (seq * k)) * mean_s prob_bse."""
    total = x.new_zeros(())
    for b in range(x.shape[0]):
        probs = torch.softmax(x[b] @ moe.router.weight.T, dim=-1)  # [seq, experts]
        chosen = probs.topk(moe.top_k, dim=-1).indices
        for e in range(moe.num_experts):
            fraction = (chosen == e).sum().item() / (x.shape[1] * moe.top_k)
            total = total + moe.num_experts * fraction * probs[:, e].mean()
    return total


def grads(module: nn.Module) -> dict[str, Tensor]:
    return {name: param.grad.clone() for name, param in module.named_parameters()}


def assert_grads_close(a: dict[str, Tensor], b: dict[str, Tensor], rel: float = 1e-5) -> None:
    """Max abs difference within `rel` of the gradient's largest entry: these gradients reach ~100 and sum
    hundreds of float32 terms (eps 1.2e-7), so reduction order moves them by ~2e-7 of that; an error in the aux
    term (coefficient 0.5 here) moves the router's by ~1e-3 of it."""
    assert a.keys() == b.keys()
    for name in a:
        error, size = (a[name] - b[name]).abs().max().item(), b[name].abs().max().item()
        assert error <= rel * size, f"{name}: max abs difference {error:.3g} with max |grad| {size:.3g}"


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("shared", [32, 0])
def test_moe_matches_per_token_reference(norm_topk_prob: bool, shared: int) -> None:
    args = dataclasses.replace(TINY, norm_topk_prob=norm_topk_prob, shared_expert_hidden_dim=shared)
    moe, x = make_moe(args), inputs()
    assert (moe.shared_expert is None) == (shared == 0)
    with torch.no_grad():
        expected = reference_moe(moe, x)
        torch.testing.assert_close(moe.eval()(x), expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(moe.train()(x), expected, rtol=0, atol=1e-5)  # the aux loss leaves values alone


def test_every_expert_gets_tokens_in_the_tests() -> None:
    """Guards the other tests: with these weights no expert is idle, so none of them passes trivially."""
    moe = make_moe().train()
    with torch.no_grad():
        moe(inputs())
    assert (moe.tokens_per_expert > 0).all()


def test_aux_loss_value_and_stats() -> None:
    moe, x = make_moe().train(), inputs()
    with torch.no_grad():
        moe(x)
        expected = reference_aux(moe, x)
    torch.testing.assert_close(moe.aux_loss_sum, expected, rtol=0, atol=1e-6)
    assert moe.aux_loss_sequences.item() == BATCH
    assert moe.tokens_per_expert.sum().item() == BATCH * SEQ * TINY.top_k
    # Balanced routing with uniform probabilities gives exactly 1 per sequence; a real router, more.
    assert (moe.aux_loss_sum / moe.aux_loss_sequences).item() > 1.0

    moe(x.detach())  # statistics add up across calls ...
    assert moe.aux_loss_sequences.item() == 2 * BATCH
    moe.reset_stats()  # ... until reset
    assert moe.tokens_per_expert.abs().sum().item() == moe.aux_loss_sum.item() == moe.aux_loss_sequences.item() == 0


@pytest.mark.parametrize("scale", [None, 0.125])
def test_aux_gradient_is_injected(scale: float | None) -> None:
    """out.sum().backward() in training mode == backward of out.sum() + coeff * scale * sum_b aux_b."""
    args = dataclasses.replace(TINY, aux_loss_coeff=0.5)  # large, so a missing aux term cannot hide in noise
    moe = make_moe(args).train()
    moe.aux_loss_scale = scale
    reference = copy.deepcopy(moe).eval()
    x = inputs().requires_grad_()
    x_ref = x.detach().clone().requires_grad_()

    moe(x).sum().backward()
    effective_scale = 1 / BATCH if scale is None else scale
    (reference(x_ref).sum() + 0.5 * effective_scale * reference_aux(reference, x_ref)).backward()
    assert_grads_close(grads(moe), grads(reference))
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)

    without_aux = copy.deepcopy(reference)
    without_aux.zero_grad()
    without_aux(x_ref.detach()).sum().backward()
    difference = (moe.router.weight.grad - without_aux.router.weight.grad).abs().max()
    assert difference > 1e-3, "the aux term must visibly change the router's gradient"


def test_aux_loss_is_invariant_to_splitting_the_batch() -> None:
    """Two halves with scale 1 / B, gradients accumulated == the whole batch with scale 1 / B."""
    whole = make_moe(dataclasses.replace(TINY, aux_loss_coeff=0.5)).train()
    whole.aux_loss_scale = 1 / BATCH
    halves = copy.deepcopy(whole)
    x = inputs()

    whole(x).sum().backward()
    for part in x.chunk(2):
        halves(part).sum().backward()
    assert_grads_close(grads(whole), grads(halves))
    torch.testing.assert_close(whole.aux_loss_sum, halves.aux_loss_sum, rtol=0, atol=1e-6)
    torch.testing.assert_close(whole.tokens_per_expert, halves.tokens_per_expert, rtol=0, atol=0)


def test_eval_mode_adds_no_aux_gradient_and_no_stats() -> None:
    moe = make_moe().eval()
    x = inputs()
    moe(x).sum().backward()
    expected = copy.deepcopy(moe)
    expected.zero_grad()
    reference_moe(expected, x).sum().backward()
    assert_grads_close(grads(moe), grads(expected))
    assert moe.tokens_per_expert.sum().item() == moe.aux_loss_sequences.item() == 0

    moe.train()  # training mode without grad (e.g. a validation pass left in train mode): stats, nothing else
    with torch.no_grad():
        out = moe(x)
    assert out.grad_fn is None and moe.aux_loss_sequences.item() == BATCH


def test_grouped_experts_runs_local_dtensor_weights_and_zero_pads(world: object) -> None:
    """Under expert parallelism the weights are Shard(0) DTensors: the module runs their local experts."""
    experts = GroupedExperts(num_experts=3, dim=8, hidden_dim=16)
    plain = [experts.w1.detach().clone(), experts.w2.detach().clone(), experts.w3.detach().clone()]
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    for name in ("w1", "w2", "w3"):
        setattr(experts, name, nn.Parameter(distribute_tensor(getattr(experts, name).detach(), mesh, [Shard(0)])))
    tokens, counts = torch.randn(7, 8), torch.tensor([2, 0, 3])
    out = experts(tokens, counts)
    expected = torch.cat([swiglu(tokens[:2], *(w[0] for w in plain)), swiglu(tokens[2:5], *(w[2] for w in plain))])
    torch.testing.assert_close(out[:5], expected, rtol=0, atol=1e-6)
    assert torch.equal(out[5:], torch.zeros(2, 8))  # rows past the groups: padding
    with pytest.raises(ValueError, match="3"):
        experts(tokens, torch.tensor([7]))


@pytest.mark.parametrize(
    "dtype, dim, grouped_matmuls",
    [(torch.bfloat16, 8, 3), (torch.float32, 8, 0), (torch.bfloat16, 4, 0)],
    ids=["bf16-grouped", "fp32-loop", "bf16-unaligned-loop"],
)
def test_grouped_experts_equal_each_expert_apart_with_their_gradients(
    dtype: torch.dtype, dim: int, grouped_matmuls: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One grouped matmul per weight in bf16 with rows of 16-byte multiples, else the loop (fp32, or 4 bf16
    values: 8 bytes): each expert's rows get exactly that expert's SwiGLU, an empty expert gets nothing, padding
    rows come back as zeros, and the input and weight gradients are those of the experts computed one by one.
    Tolerances: one rounding of sums taken in another order (fp32), or of bf16 products."""
    calls = []
    grouped_mm = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *args, **kwargs: calls.append(1) or grouped_mm(*args, **kwargs))
    torch.manual_seed(0)
    experts = GroupedExperts(num_experts=4, dim=dim, hidden_dim=16).to(dtype)
    tokens = torch.randn(13, dim, dtype=dtype, requires_grad=True)  # 11 grouped rows and 2 of padding
    counts = torch.tensor([3, 0, 6, 2])
    upstream = torch.randn(13, dim, dtype=dtype)
    (experts(tokens, counts) * upstream).sum().backward()
    assert len(calls) == grouped_matmuls
    grads = [t.grad.clone() for t in (tokens, experts.w1, experts.w2, experts.w3)]

    reference = copy.deepcopy(experts)
    reference.zero_grad(set_to_none=True)
    x = tokens.detach().clone().requires_grad_()
    rows = x[:11].split(counts.tolist())
    out = torch.cat([swiglu(r, reference.w1[e], reference.w2[e], reference.w3[e]) for e, r in enumerate(rows)])
    out = torch.cat([out, out.new_zeros(2, dim)])
    (out * upstream).sum().backward()
    tolerance = {"rtol": 0, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
    for got, expected in zip(grads, [x.grad, reference.w1.grad, reference.w2.grad, reference.w3.grad]):
        torch.testing.assert_close(got, expected, **tolerance)
    torch.testing.assert_close(experts(tokens, counts.tolist()), out, **tolerance)


def test_init_is_deterministic_and_covers_every_parameter() -> None:
    a, b, c = build(seed=0), build(seed=0), build(seed=1)
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, b.state_dict()[name]), name
    assert not torch.equal(a.layers["0"].moe.experts.w1, c.layers["0"].moe.experts.w1)
    # Buffers hold garbage after to_empty; init_weights zeroes the statistics.
    assert all(moe.tokens_per_expert.abs().sum() == 0 for moe in a.moe_layers())
    # Experts follow the feed-forward rule: w1 std 0.02, w2 shrinking with depth (std 0.02 / sqrt(2 * 2) in layer 1).
    big = build(dataclasses.replace(TINY, moe_hidden_dim=256))
    assert big.layers["1"].moe.experts.w1.std().item() == pytest.approx(0.02, rel=0.05)
    assert big.layers["1"].moe.experts.w2.std().item() == pytest.approx(0.01, rel=0.05)
    # Each expert is drawn from the parameter's own generator: experts differ from each other.
    assert not torch.equal(a.layers["0"].moe.experts.w1[0], a.layers["0"].moe.experts.w1[1])
    with pytest.raises(KeyError, match="no MoE init rule"):
        init_rule(TINY)("layers.0.moe.unknown.weight")


def test_transformer_forward_backward_and_stats() -> None:
    model = build().train()
    model.set_aux_loss_scale(0.25)
    tokens = torch.randint(0, TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    assert logits.shape == (2, 16, TINY.vocab_size)
    F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing
    moes = list(model.moe_layers())
    assert len(moes) == TINY.n_layers and all(moe.aux_loss_scale == 0.25 for moe in moes)
    assert all(moe.tokens_per_expert.sum().item() == 2 * 16 * TINY.top_k for moe in moes)


def test_transformer_kv_cache_decoding_matches_full_forward() -> None:
    """The inherited inference path works with MoE blocks: prefill + one-token steps == one full pass."""
    model, tokens = build().eval(), torch.randint(0, TINY.vocab_size, (2, 10))
    with torch.no_grad():
        full = model(tokens)
        model.setup_caches(batch_size=2, max_len=10)
        steps = [model(tokens[:, :6], start_pos=0)] + [model(tokens[:, i : i + 1], start_pos=i) for i in range(6, 10)]
        model.clear_caches()
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)


def test_mixtral_8x7b_parameter_and_flop_counts() -> None:
    args = MOE_FLAVORS["mixtral-8x7B"]
    with torch.device("meta"):
        model = MoETransformer(args)
    total = sum(p.numel() for p in model.parameters())
    active = active_params(args, total)
    assert total == pytest.approx(46.7e9, rel=0.02)  # Mistral's published counts
    assert active == pytest.approx(12.9e9, rel=0.02)
    embedding = args.vocab_size * args.dim
    expected = 6 * (active - embedding) + 12 * args.n_layers * args.dim * 4096
    assert flops_per_token(args, total, 4096) == expected


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match="top_k"):
        dataclasses.replace(TINY, top_k=5)
    with pytest.raises(ConfigError, match="num_experts"):
        dataclasses.replace(TINY, num_experts=0, top_k=0)
    with pytest.raises(ConfigError, match="shared_expert_hidden_dim"):
        dataclasses.replace(TINY, shared_expert_hidden_dim=-1)


def test_bfloat16_model_keeps_float32_router_statistics() -> None:
    """The trainer builds the model under a bf16 default dtype: experts run in bf16, statistics stay exact."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = build().train()
    finally:
        torch.set_default_dtype(default)
    tokens = torch.randint(0, TINY.vocab_size, (4, 32))
    logits = model(tokens)
    logits.float().sum().backward()
    assert logits.dtype == torch.bfloat16 and model.layers["0"].moe.experts.w1.grad.dtype == torch.bfloat16
    moe = model.layers["0"].moe
    assert moe.tokens_per_expert.dtype == torch.float32
    assert moe.tokens_per_expert.sum().item() == 4 * 32 * TINY.top_k  # 256: not exact in bf16 once counts grow
