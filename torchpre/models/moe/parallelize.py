"""Mixture-of-Experts parallelism on top of Llama 3's: its tensor- and expert-parallel plans, in one place.

- expert parallelism (`parallelism.expert_parallel_degree`): each MoE layer's experts are split over the
  ep ranks and tokens travel to them by all-to-all (`torchpre.parallel.expert_parallel`);
- tensor parallelism shards the embedding, attention and output as for Llama 3, and inside each MoE layer
  the shared expert like a dense feed-forward and the routed experts Megatron-style along their hidden
  dimension (w1/w3 [E, dim, hidden] Shard(2), w2 [E, hidden, dim] Shard(1)): every tp rank routes the
  same tokens (the router stays replicated, computed in float32), runs its hidden slice of every expert
  and the partial outputs are all-reduced once per layer. Experts that expert parallelism already
  placed on the ep mesh stay whole over tp. Under sequence parallel the MoE layer gathers the sequence
  first and returns this rank's slice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)

from torchpre.distributed.parallel_dims import ParallelDims
from torchpre.errors import ConfigError, resolve_step
from torchpre.models.args import ModelArgs
from torchpre.models.llama3.parallelize import (
    apply_llama3_context_parallel,
    apply_transformer_plan,
    attention_plan,
    check_llama3_heads,
    feed_forward_plan,
    save_sequence_shard_plan,
)
from torchpre.models.moe.args import MoEArgs
from torchpre.models.moe.model import MoE, MoEBlock, MoETransformer
from torchpre.parallel.context_parallel import ContextParallel
from torchpre.parallel.expert_parallel import apply_expert_parallel
from torchpre.parallel.tensor_parallel import apply_tensor_parallel


def llama3_attention_plan(args: ModelArgs, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Llama 3's attention plan, as `apply_moe_tensor_parallel`'s `block_attention_plan` takes it."""
    return attention_plan(sequence_parallel)


def apply_moe_tensor_parallel(
    model: MoETransformer,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool,
    loss_parallel: bool,
    block_attention_plan: Callable[[Any, bool], dict[str, ParallelStyle]] = llama3_attention_plan,
    save_sequence_shard: bool = False,
) -> None:
    """Llama 3's plan for the embedding and output, `block_attention_plan(args, sequence_parallel)` for each block's
    attention (Llama 3's; a family with another attention passes its own), plus the MoE layers' (see the module
    doc). `save_sequence_shard`: Llama 3's `save_sequence_shard_plan` after them."""
    validate_moe_tensor_parallel(model.args, tp_mesh.size())
    attention = block_attention_plan(model.args, sequence_parallel)
    moe_plan = attention | _moe_block_plan(model.args, sequence_parallel)
    dense_plan = attention | feed_forward_plan(sequence_parallel)

    def block_plan(block: nn.Module) -> dict[str, ParallelStyle]:
        return moe_plan if isinstance(block, MoEBlock) else dense_plan

    apply_transformer_plan(model, tp_mesh, block_plan, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    for moe in model.moe_layers():
        if not isinstance(moe.experts.w1, DTensor):  # not already placed by expert parallelism
            distribute_module(moe.experts, tp_mesh, _shard_hidden, input_fn=_tp_input, output_fn=_tp_output)
    if sequence_parallel and save_sequence_shard:
        apply_tensor_parallel(model, tp_mesh, save_sequence_shard_plan(model))
    model.tie_weights()


def _moe_block_plan(args: MoEArgs, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """An MoE block's feed-forward norm, shared expert and the routed layer's sequence gather (see the module doc);
    the routed experts are sharded apart, by `_shard_hidden`."""
    block_plan: dict[str, ParallelStyle] = {}
    if sequence_parallel:
        block_plan["ffn_norm"] = SequenceParallel(use_local_output=True)
        block_plan["moe"] = PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(Shard(1),),
            use_local_output=True,
        )
    if args.shared_expert_hidden_dim > 0:
        block_plan |= {  # one replicated input for w1 and w3: one gradient all-reduce for both
            "moe.shared_expert": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
            "moe.shared_expert.w1": ColwiseParallel(),
            "moe.shared_expert.w2": RowwiseParallel(),
            "moe.shared_expert.w3": ColwiseParallel(),
        }
    return block_plan


def _shard_hidden(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    """w1 and w3 [E, dim, hidden] by hidden columns, w2 [E, hidden, dim] by the matching rows."""
    for key, dim in (("w1", 2), ("w3", 2), ("w2", 1)):
        param = getattr(module, key)
        module.register_parameter(key, nn.Parameter(distribute_tensor(param, mesh, [Shard(dim)])))


def _tp_input(module: nn.Module, inputs: tuple[Tensor, Tensor], mesh: DeviceMesh) -> tuple[Tensor, Tensor]:
    """The same tokens on every tp rank; each rank's backward gives their gradient through its hidden slice
    only, so the gradient is all-reduced (Megatron's f)."""
    tokens, counts = inputs
    shared = DTensor.from_local(tokens, mesh, [Replicate()], run_check=False)
    return shared.to_local(grad_placements=[Partial()]), counts


def _tp_output(module: nn.Module, partial: Tensor, mesh: DeviceMesh) -> Tensor:
    """Sums the ranks' partial outputs (Megatron's g): an all-reduce forward, the identity backward."""
    return DTensor.from_local(partial, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()


@resolve_step
def validate_moe_tensor_parallel(args: MoEArgs, tp: int) -> None:
    """Llama 3's head checks, and whole hidden slices for the experts, the shared expert and the dense blocks."""
    check_llama3_heads(args, tp)
    widths = {"moe_hidden_dim": args.moe_hidden_dim, "shared_expert_hidden_dim": args.shared_expert_hidden_dim}
    dense = {"ffn_hidden_dim": args.ffn_hidden_dim} if args.first_k_dense else {}
    for key, width in (widths | dense).items():
        if width % tp:
            raise ConfigError(
                f"The model's {key} = {width} is not divisible by parallelism.tensor_parallel_degree "
                f"= {tp}: each tensor-parallel rank holds an equal slice of every expert. Use a divisor of it."
            )


def moe_expert_matmul_dims(args: MoEArgs, dims: ParallelDims) -> dict[str, int]:
    """The dimensions each rank's routed-expert matmuls multiply, named by the keys that set them: the model's dim
    and the experts' hidden dimension, whose slice each tensor-parallel rank holds unless expert parallelism placed
    the experts (see the module doc)."""
    if dims.tp > 1 and dims.ep == 1:
        return {"dim": args.dim, "moe_hidden_dim / parallelism.tensor_parallel_degree": args.moe_hidden_dim // dims.tp}
    return {"dim": args.dim, "moe_hidden_dim": args.moe_hidden_dim}


def apply_moe_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shards the experts of every MoE layer this model or stage holds over `ep_mesh`."""
    for moe in model.moe_layers():
        apply_expert_parallel(moe.experts, ep_mesh)


@resolve_step
def validate_moe_expert_parallel(args: MoEArgs, ep: int) -> None:
    if args.num_experts % ep:
        raise ConfigError(
            f"The model's num_experts = {args.num_experts} is not divisible by parallelism.expert_parallel_degree "
            f"= {ep}: each expert-parallel rank must hold the same number of whole experts. Use a divisor of "
            f"{args.num_experts}."
        )


def apply_moe_context_parallel(model: MoETransformer, cp: ContextParallel) -> None:
    """Llama 3's context-parallel attention, and each MoE layer's load-balancing statistics summed over the cp
    ranks of a sequence, so that its aux loss is the whole sequence's as in one process."""
    apply_llama3_context_parallel(model, cp)
    for module in model.modules():
        if isinstance(module, MoE):
            module.sequence_sum = cp.sequence_sum
