"""A training job's components, each built from its config section: the layout and the global batch, the model
(parallelized and initialised from the seed), the data, the gradient reduction and the optimizer that steps on its
result, the LR schedule, evaluation (validation loss, multiple-choice tasks), the step guard, checkpoints, Hugging
Face exports and metrics.

Everything that can reject the config (values, layout, batch arithmetic, model shapes, pipeline schedule, files)
runs first, in `preflight` (`training.preflight`), before the process group is joined and identically on every
rank, so bad input stops every rank with the same message instead of leaving some waiting for a peer. The dry run
and the planner build jobs for ranks of a fake world through the same functions (`Runtime.fake`).
"""

import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from torchpre.assembly.args import model_context
from torchpre.assembly.meta import meta_model
from torchpre.assembly.parametrization import optimizer_scales
from torchpre.assembly.plans import parallel_plan, quantize_plan
from torchpre.assembly.rope import rope_record
from torchpre.checkpoint.manager import CheckpointManager
from torchpre.checkpoint.snapshots.manager import SnapshotManager
from torchpre.checkpoint.state import RNGState
from torchpre.config.job_config import JobConfig
from torchpre.config.parser import to_toml
from torchpre.data.loader import TrainingData, build_dataloader, pins_memory
from torchpre.data.sampler import ORDER_VERSION
from torchpre.distributed.parallel_dims import Meshes, ParallelDims
from torchpre.distributed.process_groups import apply_comm_timeout, configure_flight_recorder, configure_float32_matmuls
from torchpre.evaluation.registry import EvalContext, Evaluations, build_evaluations
from torchpre.evaluation.validation import held_out_fraction
from torchpre.health.forensics import Forensics
from torchpre.health.guard import StepGuard
from torchpre.interchange.export import HFExporter
from torchpre.metrics.recorder import PipelineTiming, TrainingMetrics
from torchpre.models.attention import masked_attention
from torchpre.models.registry import ModelSpec
from torchpre.models.suffix_attention import causal_suffix_attention
from torchpre.optim.build import build_optimizer_from_config
from torchpre.optim.distributed_optimizer import DistributedOptimizer
from torchpre.optim.lr_scheduler import WarmupStableDecay, build_lr_scheduler_from_config
from torchpre.parallel.api import ParallelModel, parallelize
from torchpre.parallel.chunked_output import ChunkedProjection, chunk_output_layer
from torchpre.parallel.context_parallel import AttentionKernels, ContextParallel
from torchpre.parallel.grad_reduction import GradReduction, build_grad_reduction
from torchpre.parallel.pipeline import PipelinePlan
from torchpre.parallel.quantize import convert_linears
from torchpre.parallel.quantized_experts import quantize_experts
from torchpre.runtime.determinism import configure_determinism
from torchpre.runtime.world import Runtime
from torchpre.step_rules.batch import BatchSizes, CurrentBatch
from torchpre.training.loss import ForwardInputs, GlobalMeanLoss
from torchpre.training.model_update import StepWithModelUpdate
from torchpre.training.preflight import Preflight, preflight
from torchpre.training.state import ModelState, TrainProgress
from torchpre.training.step_plan import StepShape

logger = logging.getLogger("torchpre")

# Context parallelism's attention: mask-free causal attention of each query chunk over its key prefix, and a
# boolean mask under training.document_mask.
CONTEXT_PARALLEL_KERNELS = AttentionKernels(causal_suffix=causal_suffix_attention, masked=masked_attention)


@dataclass(kw_only=True)
class TrainingJob:
    """One rank's components of a training job (see the module docstring). `data` is None for a planner's fake
    ranks, `evaluations` empty without validation or eval.tasks, `checkpoint` without checkpoint.enable and
    checkpoint.initial_load_path, `hf_export` without hf_export.enable (and on a fake rank), `context_parallel`
    without cp; `metrics.sink` writes on rank 0 only. `batch` is the step's batch sizes, which the loss, metrics,
    data, step guard and progress read (`begin_step` publishes each step's)."""

    config: JobConfig
    runtime: Runtime
    preflight: Preflight
    device: torch.device
    meshes: Meshes
    batch: CurrentBatch
    model: ParallelModel
    num_params: int
    loss: GlobalMeanLoss
    forward_inputs: ForwardInputs
    data: TrainingData | None
    reduction: GradReduction
    optimizer: DistributedOptimizer
    lr_scheduler: WarmupStableDecay
    evaluations: Evaluations
    progress: TrainProgress
    guard: StepGuard
    checkpoint: CheckpointManager | None = None  # built once the job exists: it saves the job's components
    snapshots: SnapshotManager | None = None  # checkpoint.memory_interval's, built with `checkpoint`
    metrics: TrainingMetrics
    context_parallel: ContextParallel | None = None
    hf_export: HFExporter | None = None
    shape: StepShape | None = None  # the global batch and data stage of the step running (or last run)

    @property
    def dims(self) -> ParallelDims:
        return self.preflight.dims

    @property
    def batches(self) -> BatchSizes:
        """The batch sizes of the step running now (or last run; before any, the first step's)."""
        return self.batch.sizes

    def begin_step(self, resumed: bool = False) -> StepShape:
        """Publishes the shape of the step about to run (`StepPlan.at`: a global-batch ramp's batch, a data
        stage's data and seq_len) where it differs from the last step's, and logs the change; after a checkpoint is
        loaded (`resumed`) it logs where the run resumes instead."""
        consumed = self.data.consumed_samples if self.data is not None else 0
        shape = self.preflight.plan.at(self.progress.step, consumed)
        if shape != self.shape:
            before = self.shape
            self._use(shape)
            if before is not None and not resumed and self.is_logging_rank:
                self._log_change(before, shape, consumed)
        if resumed and self.preflight.plan.phased and self.is_logging_rank:
            logger.info(
                "resuming at step %d after %d samples: global batch %d, %s", self.progress.step, consumed,
                shape.sizes.global_batch_size, shape.stage.describe(),
            )  # fmt: skip
        return shape

    def _log_change(self, before: StepShape, shape: StepShape, consumed: int) -> None:
        step, sizes = self.progress.step + 1, shape.sizes
        if shape.stage != before.stage:
            logger.info("step %d: %s", step, shape.stage.describe())
        if sizes.global_batch_size != before.sizes.global_batch_size:
            logger.info(
                "step %d: global batch %d -> %d (training.batch_rampup after %d samples): %d microbatches of %d per DP "
                "rank", step, before.sizes.global_batch_size, sizes.global_batch_size, consumed,
                sizes.accumulation_steps, sizes.local_batch_size,
            )  # fmt: skip

    def _use(self, shape: StepShape) -> None:
        """Publishes `shape`'s batch sizes to the components that read them (`batch`), gives the model the loss
        scales of another batch (`ModelSpec.hooks.set_aux_loss_scale`: a mean over the global batch's sequences or
        tokens) and the data loader another stage's data."""
        before, self.shape = self.shape, shape
        if shape.sizes != self.batch.sizes:
            self.batch.sizes = shape.sizes
            scale_auxiliary_losses(self.preflight.model_spec, self.model, shape.sizes)
        if self.data is not None and (before is None or shape.stage != before.stage):
            self.data.enter(shape.stage.index, self.preflight.plan.first_sample(shape.stage))

    @property
    def pipeline(self) -> PipelinePlan | None:
        return self.preflight.pipeline

    @property
    def mesh(self) -> DeviceMesh:
        return self.meshes.mesh

    @property
    def is_logging_rank(self) -> bool:
        return dist.get_rank() == 0

    def checkpoint_components(self) -> dict[str, Any]:
        """The entries of this job's checkpoints (see `torchpre.checkpoint.manager`): `CHECKPOINT_ENTRIES`, the names
        checkpoint.exclude_from_loading takes, which a test keeps equal to these."""
        components = {
            "model": ModelState(self.model, self.optimizer),
            "optimizer": self.optimizer,
            "lr_scheduler": self.lr_scheduler,
            "dataloader": self.data,
            "train": self.progress,
            "rng": RNGState(),
            "health": self.guard,
        }
        return {key: component for key, component in components.items() if component is not None}


def build_job(config: JobConfig, runtime: Runtime) -> TrainingJob:
    """Checks the job, joins the process group, and builds this rank's components."""
    c, t = config.checkpoint, config.training
    pre = preflight(config, runtime.world_size)
    device = _join(config, runtime)
    meshes = pre.dims.build_meshes("cpu" if runtime.fake else device.type, fsdp=pre.data_parallel.shards_parameters)
    if not runtime.fake:
        apply_comm_timeout(*meshes.all())
    torch.manual_seed(t.seed)
    batch = CurrentBatch(pre.batches)  # the first step's, once `begin_step` has run
    data = _training_data(config, pre, meshes, device, batch) if runtime.data else None
    # Under loss parallel the logits are a vocab-sharded DTensor handled by loss_parallel's dispatch: eager.
    loss_parallel = config.parallelism.enable_loss_parallel and pre.dims.tp > 1
    loss = GlobalMeanLoss(batch, compile=config.compile.enable and not loss_parallel)
    context_parallel = None
    tokens_ahead = pre.model_spec.hooks.tokens_ahead(pre.model_args)
    if meshes.context_mesh is not None:
        bos = pre.tokenizer.bos_id if t.document_mask else None
        context_parallel = ContextParallel(
            meshes.context_mesh["cp"], t.seq_len, device, CONTEXT_PARALLEL_KERNELS, bos, tokens_ahead
        )
    forward_inputs = (
        context_parallel.forward_kwargs
        if context_parallel
        else ForwardInputs(t.document_mask, pre.tokenizer.bos_id, tokens_ahead)
    )
    model, num_params = _build_model(config, pre, meshes, device, loss, runtime.fake, context_parallel)
    projection = None
    if t.loss_chunk_size and model.last_part is not None:  # compiled without TP only: its collectives stay eager
        projection = ChunkedProjection(model.last_part, compile=config.compile.enable and pre.dims.tp == 1)
        loss.project_with(projection)
    # Through `ParallelModel.forward_only`, whose losses are `loss`'s: a share of tokens_per_step.
    evaluations = build_evaluations(EvalContext(
        config, pre.tokenizer, meshes, model, device, forward_inputs, loss_scale=lambda: loss.tokens_per_step,
        tasks=pre.eval_tasks, vocab_size=pre.model_args.vocab_size,
        shard=context_parallel.shard if context_parallel else None, projection=projection,
    ))  # fmt: skip
    reduction = build_grad_reduction(model, pre.data_parallel)
    optimizer = build_optimizer_from_config(
        model, reduction, config.optimizer, max_norm=t.max_norm, vocab_size=pre.model_args.vocab_size,
        scales=optimizer_scales(pre.model_args, config.optimizer.name),
    )
    lr_scheduler = build_lr_scheduler_from_config(optimizer.inner, config.lr_scheduler, steps=t.steps)
    d = pre.dims
    progress = TrainProgress(
        batch,
        {"world_size": d.world_size, "dp": d.dp, "tp": d.tp, "pp": d.pp, "ep": d.ep, "cp": d.cp,
         "accumulation_steps": batch.sizes.accumulation_steps, "seq_len": t.seq_len, **rope_record(pre.model_args)},
        pre.plan.stages.record(),
    )  # fmt: skip
    after_step = partial(pre.model_spec.hooks.after_optimizer_step, model.parts, pre.model_args, device)
    guard = StepGuard(
        t, StepWithModelUpdate(optimizer, after_step), _forensics(model, pre, meshes), tp_degree=d.tp, batch=batch,
        is_logging_rank=dist.get_rank() == 0,
    )  # fmt: skip
    metrics = TrainingMetrics(
        config.metrics, device, None, batch=batch,
        flops_per_token=partial(pre.model_spec.build.flops_per_token, pre.model_args, num_params), meshes=meshes.all(),
        pipeline=_pipeline_timing(model, pre.pipeline, meshes), linear=config.quantize.linear,
    )  # fmt: skip
    job = TrainingJob(
        config=config, runtime=runtime, preflight=pre, device=device, meshes=meshes, batch=batch, model=model,
        num_params=num_params, loss=loss, forward_inputs=forward_inputs, data=data, reduction=reduction,
        optimizer=optimizer, lr_scheduler=lr_scheduler, evaluations=evaluations, progress=progress, guard=guard,
        metrics=metrics, context_parallel=context_parallel,
    )  # fmt: skip
    if c.enable or c.initial_load_path:
        job.checkpoint = CheckpointManager(
            Path(config.job.dump_folder) / c.folder, job.checkpoint_components(), c, to_toml(config), pre.trust
        )
    if c.enable and c.memory_interval and not runtime.fake:
        layout = {key: job.progress.layout[key] for key in ("world_size", "dp", "tp", "pp", "ep", "cp")}
        job.snapshots = SnapshotManager(
            Path(config.job.dump_folder) / c.folder, job.checkpoint_components(), c, layout, pre.trust.signing_key,
        )  # fmt: skip
    if config.hf_export.enable and not runtime.fake:
        job.hf_export = HFExporter(
            Path(config.job.dump_folder) / config.hf_export.folder, config.hf_export, model, pre.model_spec,
            pre.model_args, pre.tokenizer, max(pre.model_args.max_seq_len, model_context(config, pre.tokenizer)),
            pre.trust.signing_key,
        )  # fmt: skip
    if not runtime.fake:
        job.begin_step()  # step 0's shape; a resume sets its step's after loading
    return job


def _join(config: JobConfig, runtime: Runtime) -> torch.device:
    """Seeds and configures the device, then joins the process group (comm.timeout_seconds after the first
    step); returns this rank's device."""
    t = config.training
    configure_determinism(t.deterministic, t.seed)
    device = runtime.device()
    configure_float32_matmuls(device, t.tf32)
    if device.type == "cuda":
        configure_flight_recorder(config.comm.trace_buf_size, Path(config.job.dump_folder) / "comm_traces")
    runtime.join(device, config.comm.init_timeout_seconds)
    return device


def _training_data(
    config: JobConfig, pre: Preflight, meshes: Meshes, device: torch.device, batch: CurrentBatch
) -> TrainingData:
    """This rank's data: the loader of the first data stage, and how to build the others' (`TrainingData.enter`)."""
    t = config.training
    dp_rank, dp_size = meshes.data_rank()
    stages = pre.plan.stages.stages

    def loader_for(index: int, order_version: int):
        stage = stages[index]
        return build_dataloader(
            dataset=t.dataset,
            dataset_path=t.dataset_path,
            tokenizer=pre.tokenizer,
            seq_len=stage.seq_len,
            local_batch_size=t.local_batch_size,
            global_batch_size=pre.batches.global_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            seed=t.seed,
            dataset_mixture=stage.mixture or t.dataset_mixture,
            num_workers=t.num_workers,
            held_out_fraction=held_out_fraction(config.validation),
            vocab_size=pre.model_args.vocab_size,
            pin_memory=pins_memory(device),
            order_version=order_version,
        )

    return TrainingData(loader_for(0, ORDER_VERSION), batch, 0, loader_for, ORDER_VERSION)


def _build_model(
    config: JobConfig,
    pre: Preflight,
    meshes: Meshes,
    device: torch.device,
    loss: GlobalMeanLoss,
    fake: bool,
    context_parallel: ContextParallel | None,
) -> tuple[ParallelModel, int]:
    """The model, or this rank's pipeline stages of it, with its parameter count: built on the
    meta device in the parameter dtype, parallelized, then materialised and initialised from the seed alone (so
    every layout starts equal). When a checkpoint will overwrite the weights, only the buffers it does not hold
    are computed (`ModelSpec.build.init_buffers`): drawing billions of values to discard them is most of start-up."""
    spec, args = pre.model_spec, pre.model_args
    model = meta_model(config, spec, args, fp32=pre.data_parallel.shards_parameters)
    if config.training.loss_chunk_size:  # checked: the family names its output layer
        chunk_output_layer(model, spec.build.output_layer, config.training.loss_chunk_size)
    # Before any parallelism: the swapped linears keep their Parameters, so TP, AC, compile and FSDP see them.
    plan = quantize_plan(config, device, spec.blocks_of(args))
    convert_linears(model, plan)
    if config.quantize.experts:  # checked: the family has set_grouped_mm
        quantize_experts(model, plan, spec.parallel.set_grouped_mm)
    num_params = sum(p.numel() for p in model.parameters())
    flops_per_token = spec.build.flops_per_token(args, num_params, config.training.seq_len)
    seed, source = config.training.seed, pre.weights
    if source.loads_weights:
        logger.info("skipped weight initialisation: loading %s", source.folder)
    build = spec.build
    init_weights = build.init_buffers if source.loads_weights or fake else lambda part: build.init_weights(part, seed)
    parallel = parallelize(
        model,
        meshes.mesh,
        parallel_plan(config, spec, args, pre.pipeline, pre.data_parallel, context_parallel),
        device=device,
        init_weights=init_weights,
        loss_fn=loss,
        expert_mesh=meshes.expert_mesh,
        dp_mesh=meshes.fsdp_mesh,
        expert_dp_mesh=meshes.expert_fsdp_mesh,
    )
    batches, d = pre.batches, pre.dims
    scale_auxiliary_losses(spec, parallel, batches)
    logger.info(
        "model %s %s: %s parameters, %s FLOPs/token; layout dp %d x tp %d x pp %d%s (ep %d); "
        "global batch %d = %d microbatches of %d per DP rank",
        config.model.name,
        config.model.hf_config if spec.args_from_job else config.model.flavor,
        f"{num_params:,}", f"{flops_per_token:,}", d.dp, d.tp, d.pp, f" x cp {d.cp}" if d.cp > 1 else "", d.ep,
        batches.global_batch_size, batches.accumulation_steps, batches.local_batch_size,
    )  # fmt: skip
    if pre.pipeline:
        logger.info("pipeline: %s", pre.pipeline.describe())
    if not args.parametrization.is_standard:
        logger.info("parametrization %s", args.parametrization.describe())
    return parallel, num_params


def scale_auxiliary_losses(spec: ModelSpec, model: ParallelModel, sizes: BatchSizes) -> None:
    """An auxiliary loss is a mean over the global batch's sequences (MoE's balance loss) or tokens (MTP's)."""
    for part in model.parts:
        spec.hooks.set_aux_loss_scale(part, 1 / sizes.global_batch_size)
        spec.hooks.set_token_loss_scale(part, 1 / sizes.tokens_per_step)


def _forensics(model: ParallelModel, pre: Preflight, meshes: Meshes) -> Forensics:
    local = pre.batches.local_batch_size
    rows = local * pre.batches.accumulation_steps // pre.pipeline.n_microbatches if pre.pipeline else local
    return Forensics(model.parts, model.stage_ids, *meshes.data_rank(), local, rows)


def _pipeline_timing(model: ParallelModel, pipeline: PipelinePlan | None, meshes: Meshes) -> PipelineTiming | None:
    if pipeline is None:
        return None
    return PipelineTiming(
        ranks=dist.get_process_group_ranks(meshes.mesh["pp"].get_group()),
        theory=pipeline.schedule.bubble(pipeline.pp, pipeline.n_microbatches, pipeline.stages_per_rank),
        busy=model.pipeline_busy_seconds,
    )
