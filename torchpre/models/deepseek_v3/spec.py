"""DeepSeek-V3 as a registered model family: `model.name = "deepseek_v3"`.

Its model is in model.py, its MLA tensor-parallel plan in parallelize.py, its Hugging Face mapping in hf.py; the
routing, router statistics, bias balancing and expert/context parallelism are the MoE family's.
"""

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from torchpre.models.deepseek_v3 import hf
from torchpre.models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS, DeepSeekV3Args, flops_per_token
from torchpre.models.deepseek_v3.model import DeepSeekV3Transformer, mtp_blocks
from torchpre.models.deepseek_v3.mtp import mtp_stats
from torchpre.models.deepseek_v3.parallelize import apply_deepseek_v3_tensor_parallel
from torchpre.models.llama3.spec import llama3_tied_weights
from torchpre.models.moe.router import router_stats
from torchpre.models.moe.spec import SPEC as MOE
from torchpre.models.registry import HFAdapter, ModelBuild, ModelSpec


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
        sublayers=MOE.build.sublayers,  # MLA in place of attention; its latent projections gathered together
    ),
    flavors=DEEPSEEK_V3_FLAVORS,
    # The MoE family's plans and hooks (routing, experts, context parallel), with MLA's tensor-parallel plan and
    # multi-token prediction's loss scale, statistics and future tokens.
    parallel=dataclasses.replace(MOE.parallel, tensor_parallel=apply_deepseek_v3_tensor_parallel),
    hooks=dataclasses.replace(
        MOE.hooks,
        set_token_loss_scale=DeepSeekV3Transformer.set_token_loss_scale,
        extra_metrics=extra_metrics,
        tokens_ahead=lambda args: args.mtp_depth + 1 if args.mtp_depth else 0,
    ),
    hf=HFAdapter(
        hf.to_hf_state_dict, hf.from_hf_state_dict, hf.hf_config, hf.hf_config_mismatches, hf.hf_sources,
        hf.args_from_hf_config,
    ),
)
