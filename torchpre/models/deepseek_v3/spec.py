"""DeepSeek-V3 as a registered model family: `model.name = "deepseek_v3"`.

Its model is in model.py, its MLA tensor-parallel plan in parallelize.py, its Hugging Face mapping in hf.py; the
routing, router statistics, bias balancing and expert/context parallelism are the MoE family's.
"""

from collections.abc import Sequence

import torch
from torch import nn

from torchpre.models.deepseek_v3 import hf
from torchpre.models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS, DeepSeekV3Args, flops_per_token
from torchpre.models.deepseek_v3.model import DeepSeekV3Transformer, mtp_blocks
from torchpre.models.deepseek_v3.mtp import mtp_stats
from torchpre.models.deepseek_v3.parallelize import apply_deepseek_v3_tensor_parallel
from torchpre.models.llama3.spec import llama3_tied_weights
from torchpre.models.moe.parallelize import (
    apply_moe_context_parallel,
    apply_moe_expert_parallel,
    moe_expert_matmul_dims,
    validate_moe_expert_parallel,
    validate_moe_tensor_parallel,
)
from torchpre.models.moe.router import router_stats, update_expert_bias
from torchpre.models.registry import HFAdapter, ModelBuild, ModelSpec, ParallelPlans, TrainingHooks


def tied_weights(args: DeepSeekV3Args) -> tuple[str, str] | None:
    """The embedding and its multi-token prediction copy (tied embeddings are refused with it), else Llama 3's."""
    return ("tok_embeddings.weight", "mtp_embeddings.weight") if args.mtp_depth else llama3_tied_weights(args)


def extra_metrics(parts: Sequence[nn.Module], args: DeepSeekV3Args, device: torch.device) -> dict[str, float]:
    """The router statistics and, with multi-token prediction, each depth's loss (`loss/mtp_k`)."""
    return router_stats(parts, args, device) | (mtp_stats(parts, args.mtp_depth, device) if args.mtp_depth else {})

SPEC = ModelSpec(
    build=ModelBuild(
        model_cls=DeepSeekV3Transformer,
        extra_blocks=mtp_blocks,
        tied_weights=tied_weights,
        flops_per_token=flops_per_token,
        output_layer="output",
    ),
    flavors=DEEPSEEK_V3_FLAVORS,
    parallel=ParallelPlans(
        tensor_parallel=apply_deepseek_v3_tensor_parallel,
        validate_tensor_parallel=validate_moe_tensor_parallel,
        expert_parallel=apply_moe_expert_parallel,
        validate_expert_parallel=validate_moe_expert_parallel,
        context_parallel=apply_moe_context_parallel,
        compile_fullgraph=False,
        set_grouped_mm=DeepSeekV3Transformer.set_grouped_mm,
        expert_matmul_dims=moe_expert_matmul_dims,
    ),
    hooks=TrainingHooks(
        set_aux_loss_scale=DeepSeekV3Transformer.set_aux_loss_scale,
        set_token_loss_scale=DeepSeekV3Transformer.set_token_loss_scale,
        extra_metrics=extra_metrics,
        tokens_ahead=lambda args: args.mtp_depth + 1 if args.mtp_depth else 0,
        after_optimizer_step=update_expert_bias,
    ),
    hf=HFAdapter(
        to_hf_state_dict=hf.to_hf_state_dict,
        from_hf_state_dict=hf.from_hf_state_dict,
        hf_config=hf.hf_config,
        hf_config_mismatches=hf.hf_config_mismatches,
        hf_sources=hf.hf_sources,
        args_from_hf_config=hf.args_from_hf_config,
    ),
)
