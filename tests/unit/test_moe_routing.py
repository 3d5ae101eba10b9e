"""The MoE routing options against transformers' DeepSeek-V3 gate, the auxiliary-loss-free bias step, the router
z-loss and dense first blocks."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from torchpre.errors import ConfigError
from torchpre.models.moe.args import MOE_FLAVORS, MoEArgs
from torchpre.models.moe.model import MoE, MoETransformer
from torchpre.models.moe.router import router_stats, update_expert_bias
from torchpre.models.moe.routing import Routing, expert_scores, route, z_loss

DSV3 = dataclasses.replace(MOE_FLAVORS["tiny_dsv3"], vocab_size=256)


def hf_gate(num_experts: int, top_k: int, n_group: int, topk_group: int, scaling: float, dim: int = 16):
    """transformers' DeepseekV3TopkRouter for these routing options."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(
        hidden_size=dim, n_routed_experts=num_experts, num_experts_per_tok=top_k, n_group=n_group,
        topk_group=topk_group, routed_scaling_factor=scaling, norm_topk_prob=True,
    )  # fmt: skip
    return DeepseekV3TopkRouter(config)


@pytest.mark.parametrize(
    "num_experts, top_k, n_group, topk_group, scaling",
    [(8, 2, 4, 2, 2.5), (16, 4, 4, 1, 1.0), (8, 3, 1, 1, 1.5)],
    ids=["grouped", "one-group-chosen", "ungrouped"],
)
def test_sigmoid_routing_matches_transformers_deepseek_v3_gate(num_experts, top_k, n_group, topk_group, scaling):
    torch.manual_seed(0)
    gate = hf_gate(num_experts, top_k, n_group, topk_group, scaling)
    with torch.no_grad():
        gate.weight.normal_()
        gate.e_score_correction_bias.normal_(std=0.3)  # large enough to change choices
    hidden = torch.randn(64, 16)
    _, hf_weights, hf_ids = gate(hidden)

    scores = expert_scores(F.linear(hidden, gate.weight), "sigmoid")
    routing = Routing(top_k, "sigmoid", n_group, topk_group, norm_topk_prob=True, routed_scaling_factor=scaling)
    weights, ids = route(scores, routing, gate.e_score_correction_bias)

    # transformers leaves the top-k unsorted: compare each token's (expert, weight) pairs in expert order.
    hf_order, order = hf_ids.argsort(dim=-1), ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order), rtol=0, atol=1e-6)
    unbiased, _ = route(scores, routing)
    assert not torch.equal(unbiased, weights)  # the bias did change some choices


def test_the_bias_changes_the_choice_not_the_weights():
    scores = torch.tensor([[0.9, 0.8, 0.1, 0.2]])
    bias = torch.tensor([0.0, -1.0, 0.0, 0.0])
    weights, ids = route(scores, Routing(2, "sigmoid", norm_topk_prob=False), bias)
    assert ids.tolist() == [[0, 3]]
    assert weights[0].tolist() == pytest.approx([0.9, 0.2])


def test_softmax_routing_without_options_is_the_plain_top_k():
    scores = torch.randn(32, 8).softmax(dim=-1)
    weights, ids = route(scores, Routing(2))
    top = scores.topk(2, dim=-1)
    assert torch.equal(ids, top.indices)
    assert torch.equal(weights, top.values / top.values.sum(dim=-1, keepdim=True))


def test_z_loss_is_the_squared_log_sum_exp():
    logits = torch.tensor([[0.0, 0.0], [1.0, 2.0]])
    expected = torch.tensor([torch.log(torch.tensor(2.0)) ** 2, torch.logsumexp(logits[1], 0) ** 2])
    torch.testing.assert_close(z_loss(logits), expected)


def test_router_z_loss_adds_its_gradient_to_the_router_only_through_the_penalty():
    args = dataclasses.replace(DSV3, aux_loss_coeff=0.0, bias_update_rate=0.0)
    x = torch.randn(2, 5, args.dim)
    grads = []
    for coeff in (0.0, 0.5):
        moe = MoE(dataclasses.replace(args, router_z_loss_coeff=coeff)).train()
        torch.manual_seed(1)
        for p in moe.parameters():
            torch.nn.init.normal_(p, std=0.1)
        out = moe(x)
        out.sum().backward()
        grads.append(moe.router.weight.grad.clone())
        logits = F.linear(x.reshape(-1, args.dim), moe.router.weight)
        penalty_grad = torch.autograd.grad(coeff * z_loss(logits).view(2, 5).mean(dim=1).mean(), moe.router.weight)[0]
        if coeff:
            torch.testing.assert_close(grads[1] - grads[0], penalty_grad, rtol=1e-4, atol=1e-6)


def test_bias_moves_towards_the_mean_load_and_not_on_a_skipped_step(world):
    model = MoETransformer(DSV3)
    model.init_weights(0)
    moes = dict(model.moe_layers_by_id())
    assert sorted(moes) == [1, 2] and "feed_forward" in dict(model.layers["0"].named_children())
    load = torch.tensor([5.0, 1, 2, 2, 2, 2, 2, 0])  # mean 2
    moes[1].step_tokens_per_expert.copy_(load)
    moes[2].step_tokens_per_expert.copy_(2 * torch.ones(8))  # even: no move
    update_expert_bias([model], DSV3, torch.device("cpu"), skip=0.0)
    rate = DSV3.bias_update_rate
    assert moes[1].expert_bias.tolist() == pytest.approx([-rate, rate, 0, 0, 0, 0, 0, rate])
    assert moes[2].expert_bias.tolist() == [0.0] * 8
    assert all(moe.step_tokens_per_expert.sum() == 0 for moe in moes.values())
    before = moes[1].expert_bias.clone()
    moes[1].step_tokens_per_expert.copy_(load)
    update_expert_bias([model], DSV3, torch.device("cpu"), skip=torch.tensor(1.0))
    assert torch.equal(moes[1].expert_bias, before) and moes[1].step_tokens_per_expert.sum() == 0


def test_bias_is_a_checkpointed_buffer_that_training_counts_for(world):
    model = MoETransformer(DSV3).train()
    model.init_weights(0)
    biases = [k for k in model.state_dict() if "expert_bias" in k]
    assert biases == ["layers.1.moe.expert_bias", "layers.2.moe.expert_bias"]
    model(torch.randint(0, DSV3.vocab_size, (2, 8))).sum().backward()
    moe = model.layers["1"].moe
    assert moe.step_tokens_per_expert.sum() == 2 * 8 * DSV3.top_k
    stats = router_stats([model], DSV3, torch.device("cpu"))
    assert stats["moe/bias_min"] == stats["moe/bias_max"] == 0.0
    update_expert_bias([model], DSV3, torch.device("cpu"), skip=0.0)
    assert moe.expert_bias.abs().max() == DSV3.bias_update_rate
    assert "expert_bias" not in str(list(MoETransformer(dataclasses.replace(DSV3, bias_update_rate=0.0)).state_dict()))


def test_dense_first_blocks_are_llama_feed_forwards_and_counted_active():
    from torchpre.models.moe.args import active_params

    model = MoETransformer(DSV3)
    dense = model.layers["0"].feed_forward
    assert dense.w1.weight.shape == (DSV3.ffn_hidden_dim, DSV3.dim)
    routed = len(DSV3.moe_layer_ids) * (DSV3.num_experts - DSV3.top_k) * 3 * DSV3.dim * DSV3.moe_hidden_dim
    num_params = sum(p.numel() for p in model.parameters())
    assert active_params(DSV3, num_params) == num_params - routed


@pytest.mark.parametrize(
    "change, message",
    [
        ({"n_group": 3}, "n_group 3 must divide num_experts 8"),
        ({"n_group": 8, "topk_group": 1}, "fewer than 2 experts per group"),
        ({"topk_group": 5}, "topk_group 5 must be between 1 and n_group 4"),
        ({"topk_group": 1, "top_k": 3}, "top_k 3 at most the 2 experts"),
        ({"score_func": "tanh"}, "score_func 'tanh' must be 'softmax' or 'sigmoid'"),
        ({"bias_update_rate": -1.0}, "bias_update_rate -1.0 must be >= 0"),
        ({"first_k_dense": 4}, "first_k_dense 4 must be between 0 and n_layers 3"),
    ],
)
def test_bad_routing_options_are_refused(change, message):
    fields = {f.name: getattr(DSV3, f.name) for f in dataclasses.fields(MoEArgs)} | change
    with pytest.raises(ConfigError, match=message):
        MoEArgs(**fields)
