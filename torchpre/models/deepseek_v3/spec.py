"""DeepSeek-V3 as a registered model family: `model.name = "deepseek_v3"`.

Its model is in model.py, its MLA tensor-parallel plan in parallelize.py, its Hugging Face mapping in hf.py; the
routing, router statistics, bias balancing and expert/context parallelism are the MoE family's.
"""

from torchpre.models.deepseek_v3 import hf
from torchpre.models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS, flops_per_token
from torchpre.models.deepseek_v3.model import DeepSeekV3Transformer
from torchpre.models.deepseek_v3.parallelize import apply_deepseek_v3_tensor_parallel
from torchpre.models.llama3.spec import llama3_tied_weights
from torchpre.models.moe.parallelize import (
    apply_moe_context_parallel,
    apply_moe_expert_parallel,
    validate_moe_expert_parallel,
    validate_moe_tensor_parallel,
)
from torchpre.models.moe.router import router_stats, update_expert_bias
from torchpre.models.registry import HFAdapter, ModelSpec

SPEC = ModelSpec(
    model_cls=DeepSeekV3Transformer,
    flavors=DEEPSEEK_V3_FLAVORS,
    tensor_parallel=apply_deepseek_v3_tensor_parallel,
    validate_tensor_parallel=validate_moe_tensor_parallel,
    expert_parallel=apply_moe_expert_parallel,
    validate_expert_parallel=validate_moe_expert_parallel,
    context_parallel=apply_moe_context_parallel,
    tied_weights=llama3_tied_weights,
    flops_per_token=flops_per_token,
    compile_fullgraph=False,
    set_aux_loss_scale=DeepSeekV3Transformer.set_aux_loss_scale,
    extra_metrics=router_stats,
    after_optimizer_step=update_expert_bias,
    hf=HFAdapter(
        to_hf_state_dict=hf.to_hf_state_dict,
        from_hf_state_dict=hf.from_hf_state_dict,
        hf_config=hf.hf_config,
        hf_config_mismatches=hf.hf_config_mismatches,
    ),
)
