"""Which experts each token goes to and with what weights: softmax or sigmoid scores, group-limited top-k, a
selection-only bias, renormalisation and scaling (DeepSeek-V3's routing; its defaults are Mixtral's top-k).

Plain tensor math, no parallelism: every rank that routes a token computes the same choice from the same
(replicated) router weight and bias.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor


@dataclass(frozen=True)
class Routing:
    """A token's routing rule (see `MoEArgs` for each option)."""

    top_k: int
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0


def expert_scores(logits: Tensor, score_func: Literal["softmax", "sigmoid"]) -> Tensor:
    """Each expert's affinity to each token, [tokens, experts], from the router logits (float32)."""
    return logits.softmax(dim=-1) if score_func == "softmax" else logits.sigmoid()


def route(scores: Tensor, routing: Routing, bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(weights, expert_ids), both [tokens, top_k], from `scores` [tokens, experts].

    `bias` [experts] shifts the scores for the choice only (auxiliary-loss-free balancing): the weights are the
    chosen experts' unbiased scores, renormalised to sum to 1 if `norm_topk_prob`, times `routed_scaling_factor`.
    """
    choice = scores if bias is None else scores + bias
    if routing.n_group > 1:
        choice = _keep_best_groups(choice, routing.n_group, routing.topk_group)
    expert_ids = choice.topk(routing.top_k, dim=-1).indices
    weights = scores.gather(1, expert_ids)
    if routing.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if routing.routed_scaling_factor != 1.0:
        weights = weights * routing.routed_scaling_factor
    return weights, expert_ids


def _keep_best_groups(choice: Tensor, n_group: int, topk_group: int) -> Tensor:
    """`choice` with -inf outside each token's `topk_group` groups of the largest sum of their two best scores."""
    groups = choice.unflatten(-1, (n_group, -1))  # [tokens, n_group, experts per group]
    group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)
    best = group_scores.topk(topk_group, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return groups.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(-2)


def z_loss(logits: Tensor) -> Tensor:
    """The router z-loss per token, [tokens]: the squared log-sum-exp of its logits (ST-MoE), which keeps them
    small enough for float32 routing."""
    return torch.logsumexp(logits, dim=-1).square()
