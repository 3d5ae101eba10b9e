"""transformers causal LMs as a registered model family: `model.name = "hf"`, args from `model.hf_config`."""

from torchpre.models.hf import convert, init, layouts, model, parallelize, probe
from torchpre.models.hf.args import hf_args
from torchpre.models.registry import HFAdapter, ModelBuild, ModelSpec, ParallelPlans

SPEC = ModelSpec(
    build=ModelBuild(
        model.HFCausalLM, model.block_path, init_weights=init.init_weights, init_buffers=init.init_buffers,
        tied_weights=model.tied_weights, flops_per_token=model.flops_per_token,
    ),
    args_from_job=hf_args,
    parallel=ParallelPlans(
        tensor_parallel=parallelize.apply_tensor_parallel_plan,
        validate_tensor_parallel=layouts.validate_tensor_parallel,
        validate_layout=layouts.validate_layout,
        stage_modules=probe.stage_modules,
        compile_fullgraph=False,  # any architecture's blocks: data-dependent ones (experts) compile around breaks
    ),
    hf=HFAdapter(
        convert.to_hf_state_dict, convert.from_hf_state_dict, convert.hf_config, convert.hf_config_mismatches,
        convert.hf_sources,
    ),
)
