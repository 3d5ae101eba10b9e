"""What a job derives from its config before it joins the process group (`Preflight`): every check that can
reject the config (values, layout, batch arithmetic, model shapes, pipeline schedule, files) runs here, identically
on every rank, so bad input stops every rank with the same message instead of leaving some waiting for a peer."""

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from torchpre.assembly.args import model_args, model_context
from torchpre.assembly.layout_checks import check_layout
from torchpre.assembly.silent_keys import check_keys_take_effect
from torchpre.assembly.tokenizer import job_tokenizer
from torchpre.assembly.weights import WeightsSource, find_resume, weights_source
from torchpre.checkpoint.integrity import Trust, check_verifiable
from torchpre.config.job_config import JobConfig
from torchpre.config.validate import validate_config
from torchpre.data.tokenizer import Tokenizer
from torchpre.distributed.parallel_dims import ParallelDims
from torchpre.errors import ConfigError, resolve_step
from torchpre.evaluation.multiple_choice import Task, read_tasks
from torchpre.evaluation.validation import check_validation_batches
from torchpre.interchange.load import FROM_HF, check_hf_folder, hf_weights
from torchpre.interchange.reader import is_hf_folder
from torchpre.models.args import ModelArgs
from torchpre.models.registry import ModelSpec, get_model_spec
from torchpre.optim.registry import check_config as check_optimizer_config
from torchpre.parallel.data_parallel import DataParallel
from torchpre.parallel.pipeline import PipelinePlan
from torchpre.step_rules.batch import BatchSizes
from torchpre.training.batches import batch_sizes
from torchpre.training.stages import StageTable
from torchpre.training.step_plan import StepPlan


@dataclass(frozen=True)
class Preflight:
    """What a job derives from its config before it joins the process group, every check passed."""

    dims: ParallelDims
    data_parallel: DataParallel
    batches: BatchSizes
    model_spec: ModelSpec
    tokenizer: Tokenizer
    model_args: ModelArgs
    pipeline: PipelinePlan | None
    trust: Trust  # what loads accept: the [checkpoint] settings with the signing key, read once
    weights: WeightsSource  # where the weights come from: the resumed checkpoint, an initial folder, or the seed
    eval_tasks: list[Task]  # eval.tasks, read and tokenized
    plan: StepPlan  # each step's global batch and data stage (a ramp, data stages)


def preflight(
    config: JobConfig,
    world_size: int,
    tokenizer: Tokenizer | None = None,
    stage_modules: Callable[..., list[list[str]]] | None = None,
) -> Preflight:
    """Every check start-up runs before the process group, in order; raises the first ConfigError. The planner,
    which checks many layouts of one job, passes the `tokenizer` it loaded and a cached `stage_modules` (default:
    `ModelSpec.pipeline_stages`, which builds the model on the meta device)."""
    validate_config(config)
    p, t, c = config.parallelism, config.training, config.checkpoint
    data_parallel = DataParallel.from_config(config)
    check_optimizer_config(config.optimizer, {
        f"optimizer.zero_stage = {data_parallel.zero_stage}": data_parallel.shards_optimizer_state,
        f"parallelism.tensor_parallel_degree = {p.tensor_parallel_degree}": p.tensor_parallel_degree > 1,
        f"parallelism.expert_parallel_degree = {p.expert_parallel_degree}": p.expert_parallel_degree > 1,
    })  # fmt: skip
    dims = ParallelDims.from_degrees(
        p.data_parallel_degree, p.tensor_parallel_degree, p.pipeline_parallel_degree, world_size,
        ep=p.expert_parallel_degree, dp_replicate=p.data_parallel_replicate_degree,
        dp_shard=p.data_parallel_shard_degree, cp=p.context_parallel_degree,
    )  # fmt: skip
    # The checkpoint a resume will load, found before anything is sized: it may fix the global batch.
    trust = Trust.from_settings(c)
    resume = find_resume(c, Path(config.job.dump_folder) / c.folder, trust)
    if c.initial_load_path and is_hf_folder(Path(c.initial_load_path)):  # read below for its shape or its weights
        check_hf_folder(Path(c.initial_load_path), trust, c.allow_unsigned_hf, "checkpoint.initial_load_path")
    elif resume is None and c.initial_load_path and config.model.flavor != FROM_HF:
        check_verifiable(Path(c.initial_load_path), "checkpoint.initial_load_path", trust)
    # A ramp's batch follows the samples consumed, not the checkpoint's batch: the global batch is the ramp's end.
    batches = batch_sizes(config, dims.dp, None if t.batch_rampup.strip() or not resume else resume.step_dir, trust)
    plan = StepPlan.from_config(config, batches, StageTable.from_config(config), dims.dp)
    spec = get_model_spec(config.model.name)
    tokenizer = checked_tokenizer(config, tokenizer)
    window = evaluation_window(config, tokenizer)
    args = model_args(config, tokenizer, max_seq_len=max(plan.stages.max_seq_len, window))
    seq_lens = sorted({stage.seq_len for stage in plan.stages.stages})
    for seq_len in seq_lens:
        check_layout(at_seq_len(config, seq_len), spec, args, dims)
    check_keys_take_effect(config, spec, args, seq_lens[0])
    weights = weights_source(c, resume, lambda path: hf_weights(path, spec, args, "checkpoint.initial_load_path"))
    eval_tasks = read_tasks(config.eval.tasks, tokenizer, window)
    pipeline = None
    if dims.pp > 1:
        split = stage_modules or ModelSpec.pipeline_stages
        first = plan.at(0, 0).sizes
        counts = {
            "embedding_layers": p.pipeline_parallel_embedding_layers,
            "output_layers": p.pipeline_parallel_output_layers,
        }
        pipeline = PipelinePlan.from_config(
            p,
            stage_modules=lambda num_stages: split(spec, args, num_stages, p.pipeline_parallel_split_points, **counts),
            sequences_per_step=t.local_batch_size * first.accumulation_steps,
        )
    check_validation_batches(config, pipeline)
    plan.check(t.steps, partial(_check_pipeline_microbatches, p) if dims.pp > 1 else lambda sequences: None)
    return Preflight(dims, data_parallel, batches, spec, tokenizer, args, pipeline, trust, weights, eval_tasks, plan)


@resolve_step
def checked_tokenizer(config: JobConfig, loaded: Tokenizer | None) -> Tokenizer:
    """The job's tokenizer (`loaded`: the one the planner read once for many layouts), which training.document_mask
    needs to mark where each document starts."""
    tokenizer = loaded or job_tokenizer(config)
    if config.training.document_mask and tokenizer.bos_id is None:
        raise ConfigError(
            f"training.document_mask finds each document by the BOS token it starts with, but the tokenizer "
            f"{tokenizer.path} starts documents with none (its family only ends them, with EOS, as Qwen's does). "
            "Turn training.document_mask off."
        )
    return tokenizer


@resolve_step
def evaluation_window(config: JobConfig, tokenizer: Tokenizer) -> int:
    """The most tokens a multiple-choice row feeds the model (eval.max_length, 0 = training.seq_len); 0 without
    tasks. The model's positions must cover it."""
    e = config.eval
    if not e.tasks:
        return 0
    if e.max_length > config.training.seq_len:
        context = model_context(config, tokenizer)
        if e.max_length > context:
            raise ConfigError(
                f"eval.max_length = {e.max_length} is longer than the model's context of {context} tokens (its "
                "flavor's max_seq_len, or model.hf_config's max_position_embeddings). Lower eval.max_length, or use "
                "0 (training.seq_len)."
            )
    return e.max_length or config.training.seq_len


def at_seq_len(config: JobConfig, seq_len: int) -> JobConfig:
    """The config with training.seq_len = `seq_len` (a data stage's), for the checks that depend on it."""
    return dataclasses.replace(config, training=dataclasses.replace(config.training, seq_len=seq_len))


def _check_pipeline_microbatches(parallelism, sequences_per_step: int) -> None:
    """The pipeline schedule's rules for a step of `sequences_per_step` per DP rank (a ramp's, a stage's)."""
    PipelinePlan.from_config(parallelism, stage_modules=lambda num_stages: [], sequences_per_step=sequences_per_step)
