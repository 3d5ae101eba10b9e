"""The Mixture-of-Experts family as a registered model: `model.name = "moe"`.

Parallelism on top of Llama 3's:
- expert parallelism (`parallelism.expert_parallel_degree`): each MoE layer's experts are split over the
  ep ranks and tokens travel to them by all-to-all (`torchpre.parallel.expert_parallel`);
- tensor parallelism shards the embedding, attention and output as for Llama 3. The MoE layers (router,
  experts, shared expert) stay whole on every tp rank and compute the same result there; under sequence
  parallel they gather the sequence first and return this rank's slice.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInputOutput, SequenceParallel

from torchpre.errors import ConfigError
from torchpre.models.llama3.parallelize import apply_transformer_plan, attention_plan, validate_llama3_tensor_parallel
from torchpre.models.llama3.spec import llama3_tied_weights
from torchpre.models.moe.args import MOE_FLAVORS, MoEArgs, flops_per_token
from torchpre.models.moe.model import MoETransformer
from torchpre.models.registry import ModelSpec
from torchpre.parallel.expert_parallel import apply_expert_parallel


def apply_moe_tensor_parallel(
    model: MoETransformer, tp_mesh: DeviceMesh, *, sequence_parallel: bool, loss_parallel: bool
) -> None:
    """Llama 3's plan for the embedding, attention and output; the MoE layers replicated (see the module doc)."""
    validate_llama3_tensor_parallel(model.args, tp_mesh.size())
    block_plan = attention_plan(sequence_parallel)
    if sequence_parallel:
        block_plan["ffn_norm"] = SequenceParallel()
        block_plan["moe"] = PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(Shard(1),),
            use_local_output=True,
        )
    apply_transformer_plan(model, tp_mesh, block_plan, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    model.tie_weights()


def apply_moe_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shards the experts of every MoE layer this model or stage holds over `ep_mesh`."""
    for moe in model.moe_layers():
        apply_expert_parallel(moe.experts, ep_mesh)


def validate_moe_expert_parallel(args: MoEArgs, ep: int) -> None:
    if args.num_experts % ep:
        raise ConfigError(
            f"The model's num_experts = {args.num_experts} is not divisible by parallelism.expert_parallel_degree "
            f"= {ep}: each expert-parallel rank must hold the same number of whole experts. Use a divisor of "
            f"{args.num_experts}."
        )


SPEC = ModelSpec(
    model_cls=MoETransformer,
    flavors=MOE_FLAVORS,
    tensor_parallel=apply_moe_tensor_parallel,
    validate_tensor_parallel=validate_llama3_tensor_parallel,
    expert_parallel=apply_moe_expert_parallel,
    validate_expert_parallel=validate_moe_expert_parallel,
    tied_weights=llama3_tied_weights,
    flops_per_token=flops_per_token,
    compile_fullgraph=False,
)
