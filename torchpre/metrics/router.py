"""Mixture-of-Experts router statistics for the metrics: how evenly each layer's experts are loaded."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from torchpre.distributed.names import canonical_fqn


def router_stats(
    model_parts: list[nn.Module], n_layers: int, num_experts: int, device: torch.device
) -> dict[str, float]:
    """Expert load over the steps since the last call, for the whole job, then resets the counters.

    Every rank adds its MoE layers' counts (routed tokens per expert, aux loss sums) into one
    [layers, experts + 2] table and the table is summed over all ranks, so data-parallel ranks, pipeline
    stages and expert-parallel groups all contribute. Tensor-parallel ranks count the same tokens and
    activation-checkpoint recomputation counts a forward twice; both scale every entry of a layer alike,
    so only ratios are reported:
    - `moe/load_imbalance`: over layers, the largest max(expert load) / mean(expert load) (1 is even);
    - `moe/min_load`: over layers, the smallest min(expert load) / mean(expert load) (0: an unused expert);
    - `moe/aux_loss`: the load-balancing loss per sequence, before its coefficient (1 is even).
    MoE layers are the modules with a `tokens_per_expert` buffer, named "layers.{i}...". A collective: every
    rank must call it.
    """
    layers = [(canonical_fqn(name), module) for part in model_parts for name, module in part.named_modules()]
    layers = [(name, module) for name, module in layers if hasattr(module, "tokens_per_expert")]
    table = torch.zeros(n_layers, num_experts + 2, dtype=torch.float64, device=device)
    for name, moe in layers:
        row = int(name.split(".")[1])  # "layers.{i}.moe"
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
        "moe/aux_loss": float(table[used, num_experts].sum() / table[used, num_experts + 1].sum()),
    }

