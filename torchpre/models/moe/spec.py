"""The Mixture-of-Experts family as a registered model: `model.name = "moe"`.

Its model is in model.py, its routing rule in routing.py, its tensor- and expert-parallel plans in parallelize.py,
its router statistics (logged as `moe/*`) and the balancing step of its routing biases in router.py.
"""

from torchpre.models.llama3.model import TransformerBlock
from torchpre.models.llama3.spec import llama3_tied_weights
from torchpre.models.moe.args import MOE_FLAVORS, flops_per_token
from torchpre.models.moe.model import MoEBlock, MoETransformer
from torchpre.models.moe.parallelize import (
    apply_moe_context_parallel,
    apply_moe_expert_parallel,
    apply_moe_tensor_parallel,
    moe_expert_matmul_dims,
    validate_moe_expert_parallel,
    validate_moe_tensor_parallel,
)
from torchpre.models.moe.router import router_stats, update_expert_bias
from torchpre.models.registry import ModelBuild, ModelSpec, ParallelPlans, TrainingHooks

# The attention and the whole feed-forward: the dense blocks' MLP, the MoE blocks' router, shared expert and routed
# experts together (under expert parallelism the routed experts are already FSDP units of their own, on the edp
# mesh). Splitting the router and shared expert from the experts without ep would save only their small share.
MOE_SUBLAYERS = ("attention", TransformerBlock.ffn_name, MoEBlock.ffn_name)

SPEC = ModelSpec(
    build=ModelBuild(
        model_cls=MoETransformer,
        tied_weights=llama3_tied_weights,
        flops_per_token=flops_per_token,
        output_layer="output",
        sublayers=MOE_SUBLAYERS,
    ),
    flavors=MOE_FLAVORS,
    parallel=ParallelPlans(
        tensor_parallel=apply_moe_tensor_parallel,
        validate_tensor_parallel=validate_moe_tensor_parallel,
        expert_parallel=apply_moe_expert_parallel,
        validate_expert_parallel=validate_moe_expert_parallel,
        context_parallel=apply_moe_context_parallel,
        saves_sequence_shard=True,
        compile_fullgraph=False,
        set_grouped_mm=MoETransformer.set_grouped_mm,
        expert_matmul_dims=moe_expert_matmul_dims,
    ),
    hooks=TrainingHooks(
        set_aux_loss_scale=MoETransformer.set_aux_loss_scale,
        extra_metrics=router_stats,
        after_optimizer_step=update_expert_bias,
    ),
)
