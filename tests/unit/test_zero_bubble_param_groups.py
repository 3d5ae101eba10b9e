"""The zero-bubble schedules' split backward (input gradients first, weight gradients later from the saved
intermediate gradients) gives a plain backward's weight gradients when one weight enters a stage twice through
branches only parameters feed, as DeepSeek-V3's multi-token prediction embedding copy does (once per depth, each
lookup through that depth's own norm, each depth reading the last). torch 2.14's parameter groups put the shared
weight in two groups, whose weight backwards then fail or count it twice; `disjoint_param_groups` and
`weight_backward` (torchpre/parallel/pipeline.py) make them exact."""

import torch
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input

from torchpre.parallel.pipeline import disjoint_param_groups, weight_backward


class TwoDepths(nn.Module):
    """Multi-token prediction's shape in miniature: each depth joins the hidden state with its own norm of a shared
    embedding's lookup. The embedding comes last, as `mtp_embeddings` does after `mtp`."""

    def __init__(self) -> None:
        super().__init__()
        self.norms = nn.ModuleList([nn.RMSNorm(4), nn.RMSNorm(4)])
        self.mixes = nn.ModuleList([nn.Linear(8, 4), nn.Linear(8, 4)])
        self.embedding = nn.Embedding(10, 4)

    def forward(self, hidden: torch.Tensor, ahead: torch.Tensor) -> torch.Tensor:
        for depth, (norm, mix) in enumerate(zip(self.norms, self.mixes)):
            hidden = mix(torch.cat((hidden, norm(self.embedding(ahead[:, depth]))), dim=-1))
        return hidden


def split_backward(model: nn.Module, hidden: torch.Tensor, ahead: torch.Tensor) -> dict[str, torch.Tensor]:
    """Input gradients, then weight gradients from the groups, as a zero-bubble stage runs them."""
    loss = model(hidden, ahead).square().sum()
    _, groups = stage_backward_input([loss], None, [hidden], model.parameters())
    weight_backward(model, disjoint_param_groups(groups))
    return {name: p.grad for name, p in model.named_parameters()}


def test_a_weight_entering_twice_gets_the_plain_backward_gradient():
    torch.manual_seed(0)
    model = TwoDepths()
    for norm in model.norms:  # not all ones, so the norms' gradients differ from each other
        nn.init.uniform_(norm.weight, 0.5, 1.5)
    hidden, ahead = torch.randn(6, 4), torch.randint(0, 10, (6, 2))
    model(hidden, ahead).square().sum().backward()
    plain = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    split = split_backward(model, hidden.clone().requires_grad_(), ahead)
    # Measured: equal to the bit. torch's own groups as torch runs them: "Trying to backward through the graph a
    # second time"; with the graph kept: the second norm's gradient doubled, the embedding's wrong; disjoint groups
    # with the graph freed group by group: the same error.
    for name, grad in plain.items():
        assert torch.equal(split[name], grad), name


def test_groups_come_out_disjoint_with_every_parameter_once():
    model = TwoDepths()
    x = torch.randn(3, 4, requires_grad=True)
    loss = model(x, torch.randint(0, 10, (3, 2))).sum()
    _, groups = stage_backward_input([loss], None, [x], model.parameters())
    merged = disjoint_param_groups(groups)
    owners = [param for group in merged for param in group["params"]]
    assert len(owners) == len(set(owners)) == len(list(model.parameters()))
    nodes = [node for group in merged for node in group["intermediates"]]
    assert len(nodes) == len(set(nodes))
