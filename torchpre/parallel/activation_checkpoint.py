"""Activation checkpointing per block: recompute activations in backward instead of storing them."""

from collections import defaultdict
from collections.abc import Sequence
from functools import cache, partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts


def _overloads(namespace: torch._ops._OpNamespace, *names: str) -> set[torch._ops.OpOverload]:
    """The `.default` overloads of those of `names` this torch (or an installed extension) registers."""
    return {getattr(namespace, name).default for name in names if hasattr(namespace, name)}


def _higher_order(*names: str) -> set[torch._ops.HigherOrderOperator]:
    """Those of `names` this torch has among its higher-order operators."""
    return {getattr(torch.ops.higher_order, name) for name in names if hasattr(torch.ops.higher_order, name)}


@cache  # on the first checkpointed forward, after the models imported flash-attn (which registers its op)
def _saved_ops() -> frozenset:
    """Outputs worth keeping under per-op selective checkpointing: the ones expensive to recompute.

    - Matmuls (every second one is recomputed anyway, see `_policy`).
    - Attention, whichever kernel runs: each SDPA backend (flash, memory-efficient, cuDNN, the CPU kernel),
      flash-attn's own op, and flex attention, both as the operator a compiled block traces and as the
      compiled region that `document_causal_attention` calls from an eager block. Recomputing it would add
      one attention forward per block to every backward, exactly where a fast kernel runs.
    - The collectives whose output is no larger than their input: the reduce-scatter of sequence parallelism,
      the all-reduce of tensor parallelism without it, the all-to-all of expert parallelism. Keeping one costs
      one activation and spares recompute a blocking collective.
      The all-gather of sequence parallelism is recomputed: its output is tp times its input, the full
      sequence that sequence parallelism exists not to keep (Megatron-LM gathers it again in backward too).
    """
    return frozenset(
        {torch.ops.aten.mm.default}
        | _overloads(
            torch.ops.aten,
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention",
            "_scaled_dot_product_flash_attention_for_cpu",
        )
        | _overloads(torch.ops.flash_attn, "_flash_attn_forward")
        | _higher_order("flex_attention", "inductor_compiled_code")
        | _overloads(torch.ops._c10d_functional, "reduce_scatter_tensor", "all_reduce", "all_to_all_single")
    )


BlockSlot = tuple[nn.Module, str]
"""A block by its parent module and its name there: where a wrapper takes its place."""


def slots(container: nn.Module) -> list[BlockSlot]:
    """The entries of a ModuleDict or ModuleList (a model's `layers`) as slots."""
    return [(container, name) for name, _ in container.named_children()]


def apply_activation_checkpointing(blocks: Sequence[BlockSlot], mode: str, selective_option: str) -> None:
    """Wraps each block in its slot, in place (names, and so parameter names in state dicts, unchanged).

    - "full": every block recomputes its whole forward in backward.
    - "selective" with an integer N: every N-th block, fully.
    - "selective" with "op": every block, keeping the outputs of matmuls, attention and the collectives listed
      in `_saved_ops` and recomputing the cheap elementwise ops (norms, activations, RoPE), except every second
      matmul, so that memory still falls (torchtitan's policy).
    """
    if mode == "none":
        return
    every = 1
    if mode == "selective" and selective_option != "op":
        every = int(selective_option)  # 'op' or a positive integer: validate_config's check
    per_op = mode == "selective" and selective_option == "op"
    for index, (parent, name) in enumerate(blocks):
        if index % every:
            continue
        block = parent.get_submodule(name)
        if per_op:
            wrapped = checkpoint_wrapper(block, context_fn=_op_policy_contexts, preserve_rng_state=False)
        else:
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        parent.register_module(name, wrapped)


def _op_policy_contexts():
    counts: dict[str, int] = defaultdict(int)
    return create_selective_checkpoint_contexts(partial(_policy, counts))


def _policy(counts: dict[str, int], ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if op not in _saved_ops():
        return CheckpointPolicy.PREFER_RECOMPUTE
    if op == torch.ops.aten.mm.default:
        key = "recompute" if ctx.is_recompute else "forward"
        counts[key] += 1
        if counts[key] % 2 == 0:  # recompute every second matmul
            return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE
