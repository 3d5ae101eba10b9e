"""One given layout, evaluated as the job's keys set it (`python -m torchpre.plan --fixed`), instead of searched.

A search rewrites each candidate's keys (`Layout.apply`); a fixed layout keeps every key the user wrote (sequence
parallelism, the selective-AC option, compile, quantize, the schedule) and is checked by start-up's own checks as
it stands, so the prediction is of exactly the run the same keys would start.
"""

import copy

from torchpre.assembly.tokenizer import tokenizer_path
from torchpre.config.job_config import JobConfig
from torchpre.planner.hardware import Hardware
from torchpre.planner.layout_space import CheckedLayout, Layout, cached_stage_modules, cached_tokenizer
from torchpre.planner.predict import Prediction, model_flops_per_token, predict
from torchpre.training.preflight import preflight


def layout_of(config: JobConfig) -> Layout:
    """The `Layout` the job's parallelism, ZeRO and AC keys describe (data_parallel_degree resolved)."""
    p = config.parallelism
    pipelined = p.pipeline_parallel_degree > 1
    return Layout(
        dp=p.data_parallel_degree,
        tp=p.tensor_parallel_degree,
        pp=p.pipeline_parallel_degree,
        ep=p.expert_parallel_degree,
        zero_stage=config.optimizer.zero_stage,
        activation_checkpoint=config.activation_checkpoint.mode,
        microbatch_size=p.pipeline_parallel_microbatch_size if pipelined else config.training.local_batch_size,
        schedule=p.pipeline_parallel_schedule if pipelined else "",
        virtual_stages=p.pipeline_parallel_virtual_stages if pipelined else 1,
        cp=p.context_parallel_degree,
    )


def check_fixed(config: JobConfig, gpus: int) -> CheckedLayout:
    """The job on `gpus` GPUs through start-up's checks, its keys untouched but data_parallel_degree = -1 resolved
    (the planner's probes re-shape the job around its degrees); their ConfigError if refused."""
    checked = preflight(config, gpus, cached_tokenizer(tokenizer_path(config)), cached_stage_modules)
    config = copy.deepcopy(config)
    config.parallelism.data_parallel_degree = checked.dims.dp
    accumulation = checked.batches.accumulation_steps
    return CheckedLayout(layout_of(config), config, checked.model_args, accumulation, checked.pipeline)


def predict_fixed(config: JobConfig, hardware: Hardware, gpus: int) -> Prediction:
    """`predict` for the job's own layout."""
    checked = check_fixed(config, gpus)
    return predict(checked, hardware, gpus, model_flops_per_token(checked.config, checked.model_args))
