"""Activation checkpointing per block: recompute activations in backward instead of storing them."""

from collections import defaultdict
from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from torchpre.errors import ConfigError

# Outputs worth keeping under per-op selective checkpointing: the expensive ones to recompute.
_SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def apply_activation_checkpointing(blocks: nn.Module, mode: str, selective_option: str) -> None:
    """Wraps the blocks of `blocks` (a ModuleDict or ModuleList) in place (keys, and so parameter names in state
    dicts, unchanged).

    - "full": every block recomputes its whole forward in backward.
    - "selective" with an integer N: every N-th block, fully.
    - "selective" with "op": every block, keeping the outputs of matmuls and attention and
      recomputing the cheap elementwise ops (norms, activations, RoPE), except every second matmul,
      so that memory still falls (torchtitan's policy).
    """
    if mode == "none":
        return
    every = 1
    if mode == "selective" and selective_option != "op":
        if not selective_option.isdigit() or int(selective_option) < 1:
            raise ConfigError(
                f"activation_checkpoint.selective_ac_option = '{selective_option}': use 'op' or a positive "
                "integer N (checkpoint every N-th block)."
            )
        every = int(selective_option)
    per_op = mode == "selective" and selective_option == "op"
    for index, (name, block) in enumerate(list(blocks.named_children())):
        if index % every:
            continue
        if per_op:
            wrapped = checkpoint_wrapper(block, context_fn=_op_policy_contexts, preserve_rng_state=False)
        else:
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        blocks.register_module(name, wrapped)


def _op_policy_contexts():
    counts: dict[str, int] = defaultdict(int)
    return create_selective_checkpoint_contexts(partial(_policy, counts))


def _policy(counts: dict[str, int], ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if op not in _SAVED_OPS:
        return CheckpointPolicy.PREFER_RECOMPUTE
    if op == torch.ops.aten.mm.default:
        key = "recompute" if ctx.is_recompute else "forward"
        counts[key] += 1
        if counts[key] % 2 == 0:  # recompute every second matmul
            return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE
