"""Llama 3 tensor parallelism (+ sequence parallel, + loss parallel): its plan, in one place.

Megatron-style sharding over the `tp` mesh dimension (tp ranks):
- `tok_embeddings`: vocab-parallel, weight [vocab, dim] Shard(0). Each rank looks up the tokens
  in its vocab rows; the partial embeddings are all-reduced (reduce-scattered over the sequence
  under SP).
- `attention.wq/wk/wv` and `feed_forward.w1/w3`: column-parallel, weight Shard(0). Each rank
  holds n_heads/tp query heads, n_kv_heads/tp key/value heads and hidden/tp feed-forward units, so
  attention and the SwiGLU product (or GELU, model.mlp; that MLP has no w3) run on local shards with no
  communication.
- `attention.wo` and `feed_forward.w2`: row-parallel, weight Shard(1). Their partial outputs
  are all-reduced (reduce-scattered over the sequence under SP).
- `output`: column-parallel, weight Shard(0), the same placement as the embedding, so tied
  embeddings remain one Parameter. The logits are all-gathered into a plain [batch, seq, vocab]
  tensor, or, under loss parallel, returned as a vocab-sharded Shard(-1) DTensor for
  cross-entropy inside `torchpre.parallel.tensor_parallel.loss_parallel_context`. Under
  training.loss_chunk_size (a `ChunkedOutput`) the weight is sharded alike and the loss computes
  each rank's vocabulary shard of each chunk's logits, with or without loss parallel.
- Norms: replicated. Under SP they run on this rank's slice of the sequence and their weights
  become Replicate DTensors.

Under SP the residual stream between blocks is each rank's [batch, seq/tp, dim] slice, a plain
local tensor (also what a pipeline stage sends to the next), and attention and feed-forward
all-gather their normalized input over the sequence; this needs seq_len divisible by tp.

After backward the embedding's gradient is whole on every rank (Replicate) and, under SP, the
norms' are per-rank Partial sums; `torchpre.parallel.tensor_parallel.reduce_partial_gradients`
gives them their parameters' placements.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from torchpre.errors import ConfigError, resolve_step
from torchpre.models.llama3.args import TransformerArgs
from torchpre.models.llama3.model import Transformer
from torchpre.parallel.chunked_output import ChunkedOutput, VocabParallelOutput
from torchpre.parallel.context_parallel import ContextParallel
from torchpre.parallel.mlp_activation import recompute_mlp_activation
from torchpre.parallel.sequence_gather import SaveShardForBackward
from torchpre.parallel.tensor_parallel import apply_tensor_parallel, check_whole_heads


@resolve_step
def validate_llama3_tensor_parallel(args: TransformerArgs, tp: int) -> None:
    """Fail fast, before any process-group work, if `tp` ranks cannot hold whole heads and equal slices of the
    feed-forward width (DTensor would shard it unevenly, and the row-parallel w2 would not match w1's shard)."""
    check_llama3_heads(args, tp)
    width = args.ffn_hidden_dim
    if width % tp:
        degrees = ", ".join(str(d) for d in range(1, min(width, 64) + 1) if width % d == 0)
        raise ConfigError(
            f"The model's feed-forward width ffn_hidden_dim = {width} (a config.json's intermediate_size) is not "
            f"divisible by parallelism.tensor_parallel_degree = {tp}: each tensor-parallel rank holds an equal slice "
            f"of w1, w2 (and SwiGLU's w3). Set parallelism.tensor_parallel_degree to a divisor of {width} ({degrees}), "
            "or use a model whose width it divides."
        )


def check_llama3_heads(args: TransformerArgs, tp: int) -> None:
    """Rejects a `tp` that splits Llama 3's query or key/value heads."""
    check_whole_heads(
        ("n_heads", args.n_heads), ("n_kv_heads", args.n_kv_heads), tp, "The model's",
        ", or choose a model.flavor with more heads",
    )


def apply_llama3_tensor_parallel(
    model: Transformer,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool,
    loss_parallel: bool,
    save_sequence_shard: bool = False,
) -> None:
    """Shard `model` (a whole model or a pipeline stage) in place over the 1-D `tp_mesh`.

    Call it on the meta device, before `to_empty` and `init_weights`. The plan covers only the
    parts this stage holds. `save_sequence_shard` (parallelism.sequence_parallel_save_shard): see
    `save_sequence_shard_plan`.
    """
    validate_llama3_tensor_parallel(model.args, tp_mesh.size())
    block_plan = attention_plan(sequence_parallel) | feed_forward_plan(sequence_parallel, gated=model.args.gated_mlp)
    apply_transformer_plan(model, tp_mesh, block_plan, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    if sequence_parallel and save_sequence_shard:
        apply_tensor_parallel(model, tp_mesh, save_sequence_shard_plan(model))


def save_sequence_shard_plan(model: Transformer) -> dict[str, ParallelStyle]:
    """Under SP, every attention and feed-forward (dense or MoE) this stage holds saves its sequence shard for
    backward and gathers it again there, instead of saving the gathered input (`torchpre.parallel.sequence_gather`);
    for the families built on Llama 3's `Transformer`, applied after their plan (its gather runs first)."""
    return {
        f"{block_path}.{name}": SaveShardForBackward()
        for block_path, block in model.attention_blocks()
        for name in ("attention", "feed_forward", "moe")
        if getattr(block, name, None) is not None
    }


def recompute_llama3_mlp_activations(model: Transformer) -> None:
    """Every block this stage holds keeps only its dense MLP's projections' outputs for backward
    (activation_checkpoint.recompute_mlp_activation, `torchpre.parallel.mlp_activation`)."""
    for _, block in model.attention_blocks():
        recompute_mlp_activation(block.feed_forward)


def apply_transformer_plan(
    model: Transformer,
    tp_mesh: DeviceMesh,
    block_plan: dict[str, ParallelStyle] | Callable[[nn.Module], dict[str, ParallelStyle]],
    *,
    sequence_parallel: bool,
    loss_parallel: bool,
) -> None:
    """Applies the embedding / norm / output plan and `block_plan` (keys relative to a block) to every block
    this stage holds; for the families built on Llama 3's `Transformer`. A callable `block_plan` gives each
    block its own plan (a family whose blocks differ, e.g. dense ones before MoE ones)."""
    plan = _outer_plan(model, sequence_parallel, loss_parallel)
    plan_of = block_plan if callable(block_plan) else lambda block: block_plan
    plan |= {
        f"{block_path}.{path}": style
        for block_path, block in model.attention_blocks()
        for path, style in plan_of(block).items()
    }
    apply_tensor_parallel(model, tp_mesh, plan)
    # parallelize_module gave the embedding and the output layer new Parameters. Both are
    # Shard(0) of [vocab, dim] on the same mesh, so one DTensor Parameter can serve as both.
    model.tie_weights()


def _outer_plan(
    model: Transformer, sequence_parallel: bool, loss_parallel: bool
) -> dict[str, ParallelStyle]:
    """Embedding, final norm and output layer, for those this stage holds."""
    residual = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=residual)
    if model.norm is not None and sequence_parallel:
        plan["norm"] = SequenceParallel()
    if isinstance(model.output, ChunkedOutput):  # training.loss_chunk_size: vocabulary-parallel, chunk by chunk
        plan["output"] = VocabParallelOutput(input_layout=residual)
    elif model.output is not None:
        plan["output"] = ColwiseParallel(
            input_layouts=residual,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    return plan


def attention_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """A block's attention and its norm, keys relative to the block.

    Attention and feed-forward each turn their input into one replicated DTensor shared by their
    column-parallel projections, so the backward sums those projections' input gradients with a
    single collective per module instead of one per projection. Under SP that is also where the
    sequence is all-gathered, and wo / w2 reduce-scatter it back. The attention's second input,
    the RoPE cache, is a plain tensor every rank holds in full (layout None).

    The sequence-parallel norm hands on its output as a plain local shard, which the attention's
    `PrepareModuleInput` wraps again: with compile.enable each of a block's children is a graph of
    its own, and a DTensor passed from one to the next lost its gradient's reduce-scatter on torch
    2.14 (every gradient below the last MLP wrong, up to 3x;
    tests/distributed/test_parallel_parity.py's tp2_sp_compile row).
    """
    residual = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "attention": PrepareModuleInput(
            input_layouts=(residual, None), desired_input_layouts=(Replicate(), None)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=residual),
    }
    if sequence_parallel:
        plan["attention_norm"] = SequenceParallel(use_local_output=True)
    return plan


def feed_forward_plan(sequence_parallel: bool, gated: bool = True) -> dict[str, ParallelStyle]:
    """A block's feed-forward and its norm, sharded like attention (see `attention_plan`): w1 (and SwiGLU's gate w3,
    when `gated`) column-parallel, w2 row-parallel, so the activation runs on each rank's slice of the width."""
    residual = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "feed_forward": PrepareModuleInput(
            input_layouts=(residual,), desired_input_layouts=(Replicate(),)
        ),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=residual),
    }
    if gated:
        plan["feed_forward.w3"] = ColwiseParallel()
    if sequence_parallel:
        plan["ffn_norm"] = SequenceParallel(use_local_output=True)
    return plan


def apply_llama3_context_parallel(model: Transformer, cp: ContextParallel) -> None:
    """Makes every attention layer this stage holds attend over the whole sequence while its input holds this
    rank's cp positions (`torchpre.parallel.context_parallel`): a forward pre-hook gives it the RoPE rows of
    those positions and `cp.attend` as the attention that owns the mask. Under the document mask a pre-hook on
    the stage turns the microbatch's `document_ids` (the whole rows', `ContextParallel.forward_kwargs`) into that
    attention's doc_mask: the mask of each microbatch travels in its own forward's arguments, which activation
    checkpointing replays and pipeline schedules keep apart. The model code stays unaware of cp; for the
    families built on Llama 3's `Transformer`."""
    model.register_forward_pre_hook(partial(_context_parallel_documents, cp), with_kwargs=True)
    for _, block in model.attention_blocks():
        block.attention.register_forward_pre_hook(partial(_context_parallel_inputs, cp), with_kwargs=True)


def _context_parallel_documents(
    cp: ContextParallel, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    document_ids = kwargs.pop("document_ids", None)
    if document_ids is not None:
        kwargs["doc_mask"] = cp.document_attention(document_ids)
    return args, kwargs


def _context_parallel_inputs(
    cp: ContextParallel, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x, rope_cache, *rest = args
    attend = kwargs.get("doc_mask")  # the microbatch's document attention, under the document mask
    return (x, cp.rope_rows(rope_cache), *rest), {**kwargs, "doc_mask": cp.attend if attend is None else attend}
