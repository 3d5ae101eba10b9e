"""Tensor parallelism (+ sequence parallel, + loss parallel) for transformers' Llama-layout decoders.

The same Megatron-style sharding as torchpre's Llama (`torchpre.models.llama3.parallelize`), on transformers'
module names: the embedding vocab-parallel, q/k/v_proj and gate/up_proj column-parallel (their biases, Qwen2's
q/k/v, with them), o_proj and down_proj row-parallel, lm_head column-parallel, norms replicated. transformers'
attention reshapes with `view(..., -1, head_dim)`, so it runs on a rank's heads unchanged. Qwen3's q_norm and
k_norm normalise each head: they run on the rank's heads as a head-sharded DTensor, so their weight gradients are
summed over the ranks like the sequence-parallel norms'.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from torchpre.models.hf.args import HFArgs
from torchpre.models.hf.model import HFCausalLM
from torchpre.parallel.tensor_parallel import apply_tensor_parallel, check_whole_heads

HEAD_NORMS = {"qwen3": ("q_norm", "k_norm")}  # per-head RMSNorms inside attention, by model_type


def validate_tensor_parallel(args: HFArgs, tp: int) -> None:
    """Each tensor-parallel rank must hold whole query and key/value heads."""
    check_whole_heads(
        ("num_attention_heads", args.n_heads), ("num_key_value_heads", args.n_kv_heads), tp, f"{args.path}:", ""
    )


def apply_tensor_parallel_plan(
    model: HFCausalLM, tp_mesh: DeviceMesh, *, sequence_parallel: bool, loss_parallel: bool
) -> None:
    """Shards `model` (the whole model or a pipeline stage, on the meta device) in place over `tp_mesh`."""
    residual = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {}
    if model.model.embed_tokens is not None:
        plan["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=residual)
    if model.model.norm is not None and sequence_parallel:
        plan["model.norm"] = SequenceParallel()
    if model.lm_head is not None:
        plan["lm_head"] = ColwiseParallel(
            input_layouts=residual,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if any(layer is not None for layer in model.model.layers):
        block = block_plan(model.config.model_type, sequence_parallel)
        plan |= {f"model.layers.*.{path}": style for path, style in block.items()}
    apply_tensor_parallel(model, tp_mesh, plan)
    model.sequence_shards = tp_mesh.size() if sequence_parallel else 1


def block_plan(model_type: str, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """One decoder layer's plan, keys relative to the layer. Attention and the MLP each make their input one
    replicated DTensor (gathered over the sequence under SP) shared by their column-parallel projections."""
    residual = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        # transformers' decoder layer passes hidden_states to attention by keyword.
        "self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": residual},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
        ),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=residual),
        "mlp": PrepareModuleInput(input_layouts=(residual,), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=residual),
    }
    for norm in HEAD_NORMS.get(model_type, ()):
        # [batch, seq, local heads, head_dim]: this rank's heads are a Shard(2) of all heads.
        plan[f"self_attn.{norm}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if sequence_parallel:
        plan["input_layernorm"] = SequenceParallel()
        plan["post_attention_layernorm"] = SequenceParallel()
    return plan
