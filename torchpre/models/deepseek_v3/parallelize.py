"""DeepSeek-V3 parallelism: the MoE family's plans (embedding, output, experts, expert and context parallelism)
with multi-head latent attention's tensor-parallel plan, in one place.

Tensor parallelism shards MLA over heads: the up-projections `wq_b` (or `wq` without a query latent) and `wkv_b`
are column-parallel, so each rank expands its own heads' queries, keys and values, and `wo` is row-parallel, its
partial outputs all-reduced (reduce-scattered over the sequence under SP). The down-projections `wq_a` and `wkv_a`
and the latents' norms stay replicated, as torchtitan does: their outputs are small (q_lora_rank, kv_lora_rank +
qk_rope_head_dim: 2,112 wide against the 7,168 input in the 671B model) and every rank needs them whole, the RMSNorm
over the whole latent and the RoPE key shared by every head; sharding them would add an all-gather per latent in
forward for ~8% of the attention's weights. Each rank computes them on the gathered input, as plain tensors. In
backward the gradient of what they produce must be whole on every rank, so that their weights' gradients are equal
everywhere (nothing left to reduce) and so is the attention input's: the column-parallel up-projections take the
latents as plain tensors and all-reduce their input gradients (Megatron's f, once per latent), and the RoPE key,
which each rank's heads use without a projection, has its gradient summed over the ranks by `SharedRopeKey` (on
`wkv_a`, whose output holds it).

Context parallelism: MLA attends through the shared attention kernels with per-head queries, keys and values, so
the MoE family's hook (Llama 3's: RoPE rows of this rank's positions and `ContextParallel.attend`) applies as is.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from torchpre.models.deepseek_v3.args import DeepSeekV3Args
from torchpre.models.deepseek_v3.model import DeepSeekV3Transformer
from torchpre.models.moe.parallelize import apply_moe_tensor_parallel
from torchpre.parallel.tensor_parallel import apply_tensor_parallel


def mla_attention_plan(args: DeepSeekV3Args, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """A block's MLA and its norm, keys relative to the block (see the module doc)."""
    residual = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "attention": PrepareModuleInput(
            input_layouts=(residual, None), desired_input_layouts=(Replicate(), None), use_local_output=True
        ),
        "attention.wq" if args.q_lora_rank == 0 else "attention.wq_b": ColwiseParallel(),
        "attention.wkv_a": SharedRopeKey(args.qk_rope_head_dim),
        "attention.wkv_b": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=residual),
    }
    if sequence_parallel:
        plan["attention_norm"] = SequenceParallel(use_local_output=True)
    return plan


class SharedRopeKey(ParallelStyle):
    """For the replicated `wkv_a`: the last `rope_dim` columns of its output are the RoPE key every head shares, which
    reaches each rank's heads only, so its gradient is summed over the tp ranks in backward (identity forward). The
    latent's columns need nothing: column-parallel `wkv_b` returns their gradient whole."""

    def __init__(self, rope_dim: int) -> None:
        super().__init__()
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_hook(partial(_sum_rope_key_gradient, device_mesh, self.rope_dim))
        return module


def _sum_rope_key_gradient(mesh: DeviceMesh, rope_dim: int, module: nn.Module, inputs: tuple, output: Tensor) -> Tensor:
    latent, rope_key = output.split([output.shape[-1] - rope_dim, rope_dim], dim=-1)
    shared = DTensor.from_local(rope_key, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
    return torch.cat((latent, shared), dim=-1)


def apply_deepseek_v3_tensor_parallel(
    model: DeepSeekV3Transformer,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool,
    loss_parallel: bool,
    save_sequence_shard: bool = False,
) -> None:
    """The MoE family's plan with MLA's attention plan for every block (the multi-token prediction's too), then the
    multi-token prediction's own layers (`mtp_plan`)."""
    apply_moe_tensor_parallel(
        model, tp_mesh, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
        block_attention_plan=mla_attention_plan, save_sequence_shard=save_sequence_shard,
    )
    if model.mtp is not None and model.mtp.depths:
        apply_tensor_parallel(model, tp_mesh, mtp_plan(model, sequence_parallel))
        model.tie_weights()


def mtp_plan(model: DeepSeekV3Transformer, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The multi-token prediction around its blocks. Its embedding copy is the embedding's plan (vocab-parallel;
    one Parameter with it where this part holds both: `tie_weights`). The norms and the projection are replicated:
    under SP they run on this rank's positions (`SequenceParallel`, their weight gradients summed over tp as the
    block norms' are), so the projection returns the sequence-sharded residual a block takes; without SP every rank
    computes them whole, as the block norms."""
    plan: dict[str, ParallelStyle] = {}
    if model.tok_embeddings is None:
        residual = Shard(1) if sequence_parallel else Replicate()
        plan["mtp_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=residual)
    if sequence_parallel:
        for name in ("embedding_norm", "hidden_norm", "projection"):
            plan[f"mtp.depths.*.{name}"] = SequenceParallel(use_local_output=True)
        plan["mtp.depths.*.norm"] = SequenceParallel()
    return plan
