"""The Mixture-of-Experts hooks that need the whole job: router statistics for the metrics (how evenly each layer's
experts are loaded) and the auxiliary-loss-free balancing step of the routing biases."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from torchpre.models.moe.args import MoEArgs
from torchpre.models.moe.model import MoETransformer


def router_stats(model_parts: Sequence[MoETransformer], args: MoEArgs, device: torch.device) -> dict[str, float]:
    """Expert load over the steps since the last call, for the whole job, then resets the counters.

    Every rank adds its MoE layers' counts (routed tokens per expert, aux loss sums) into one
    [layers, experts + 2] table and the table is summed over all ranks, so data-parallel ranks, pipeline
    stages and expert-parallel groups all contribute. Tensor-parallel ranks count the same tokens and
    activation-checkpoint recomputation counts a forward twice; both scale every entry of a layer alike,
    so only ratios are reported:
    - `moe/load_imbalance`: over layers, the largest max(expert load) / mean(expert load) (1 is even);
    - `moe/min_load`: over layers, the smallest min(expert load) / mean(expert load) (0: an unused expert);
    - `moe/aux_loss`: the load-balancing loss per sequence, before its coefficient (1 is even), averaged over layers;
    - `moe/bias_min`, `moe/bias_max`: with bias balancing, the smallest and largest routing bias over layers.
    A collective: every rank must call it (the family's `ModelSpec.hooks.extra_metrics`).
    """
    num_experts = args.num_experts
    table = torch.zeros(args.router_rows, num_experts + 2, dtype=torch.float64, device=device)
    for part in model_parts:
        for row, moe in part.moe_layers_by_id():
            table[row, :num_experts] = moe.tokens_per_expert.double()
            table[row, num_experts] = moe.aux_loss_sum.double()
            table[row, num_experts + 1] = moe.aux_loss_sequences.double()
            moe.reset_stats()
    dist.all_reduce(table)
    load = table[:, :num_experts]
    used = load.sum(dim=1) > 0
    if not used.any():
        return {}
    load, mean = load[used], load[used].mean(dim=1)
    return {
        "moe/load_imbalance": float((load.max(dim=1).values / mean).max()),
        "moe/min_load": float((load.min(dim=1).values / mean).min()),
        # Per layer, then averaged: activation checkpointing recounts only the layers it wraps.
        "moe/aux_loss": float((table[used, num_experts] / table[used, num_experts + 1]).mean()),
        **(_bias_range(model_parts, device) if args.bias_update_rate > 0 else {}),
    }


def _bias_range(model_parts: Sequence[MoETransformer], device: torch.device) -> dict[str, float]:
    """The smallest and largest routing bias of the job's MoE layers (pipeline stages hold different ones)."""
    extremes = torch.full((2,), -torch.inf, dtype=torch.float64, device=device)  # [max, -min]
    for part in model_parts:
        for _, moe in part.moe_layers_by_id():
            bias = moe.expert_bias.double()
            extremes = torch.maximum(extremes, torch.stack([bias.max(), -bias.min()]))
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    return {"moe/bias_min": float(-extremes[1]), "moe/bias_max": float(extremes[0])}


@torch.no_grad()
def update_expert_bias(
    model_parts: Sequence[MoETransformer], args: MoEArgs, device: torch.device, skip: torch.Tensor | float
) -> None:
    """Auxiliary-loss-free balancing (DeepSeek-V3), after each optimizer step: every MoE layer's `expert_bias` moves
    by `bias_update_rate * sign(mean load - load_e)`, from the step's job-wide assignments per expert; nothing moves
    where `skip` is 1 (a step not applied: a float, or a one-element tensor on the device, read there). Each layer's
    step counts are then reset.

    The counts are summed over all ranks as in `router_stats`: data-, context- and expert-parallel ranks saw different
    tokens, pipeline stages hold different layers. Tensor-parallel ranks and activation-checkpoint recomputation
    multiply a layer's counts alike, which the sign ignores; the sign is taken of an exact integer difference,
    so every rank, and one process, computes the same bias to the bit. A collective: every rank calls it (the
    family's `ModelSpec.hooks.after_optimizer_step`).
    """
    if args.bias_update_rate == 0:
        return
    layers = [(row, moe) for part in model_parts for row, moe in part.moe_layers_by_id()]
    load = torch.zeros(args.router_rows, args.num_experts, dtype=torch.float64, device=device)
    for row, moe in layers:
        load[row] = moe.step_tokens_per_expert.double()
        moe.step_tokens_per_expert.zero_()
    dist.all_reduce(load)
    # sign(mean - load_e) as sign(total - num_experts * load_e): integers, exact in float64.
    direction = torch.sign(load.sum(dim=1, keepdim=True) - args.num_experts * load).float()
    update = args.bias_update_rate * direction * (1 - skip)
    for row, moe in layers:
        moe.expert_bias += update[row]
