"""Llama 3 as a registered model family: `model.name = "llama3"`."""

from torchpre.models.llama3 import hf
from torchpre.models.llama3.args import LLAMA3_FLAVORS, TransformerArgs, flops_per_token
from torchpre.models.llama3.model import Transformer, TransformerBlock
from torchpre.models.llama3.parallelize import (
    apply_llama3_context_parallel,
    apply_llama3_tensor_parallel,
    recompute_llama3_mlp_activations,
    validate_llama3_tensor_parallel,
)
from torchpre.models.registry import HFAdapter, ModelBuild, ModelSpec, ParallelPlans


def llama3_tied_weights(args: TransformerArgs) -> tuple[str, str] | None:
    """The two copies of the tied embedding when the first and last stage hold one each."""
    return ("tok_embeddings.weight", "output.weight") if args.tie_word_embeddings else None


SPEC = ModelSpec(
    build=ModelBuild(
        model_cls=Transformer,
        tied_weights=llama3_tied_weights,
        flops_per_token=flops_per_token,
        output_layer="output",
        sublayers=("attention", TransformerBlock.ffn_name),
    ),
    flavors=LLAMA3_FLAVORS,
    parallel=ParallelPlans(
        tensor_parallel=apply_llama3_tensor_parallel,
        validate_tensor_parallel=validate_llama3_tensor_parallel,
        context_parallel=apply_llama3_context_parallel,
        saves_sequence_shard=True,
        recompute_mlp_activation=recompute_llama3_mlp_activations,
    ),
    hf=HFAdapter(
        hf.to_hf_state_dict, hf.from_hf_state_dict, hf.hf_config, hf.hf_config_mismatches, hf.hf_sources,
        hf.args_from_hf_config,
    ),
)
