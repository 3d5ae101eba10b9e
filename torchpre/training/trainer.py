"""The training loop, assembled from the config: model, data, optimizer, parallelism, metrics."""

import contextlib
import logging
import socket
import sys
import time
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from torchpre.checkpoint.history import set_aside_earlier_metrics, set_aside_later_steps
from torchpre.checkpoint.layout import layout_change
from torchpre.checkpoint.manager import CheckpointManager, find_step_dir, saved_global_batch_size
from torchpre.config.job_config import JobConfig
from torchpre.config.parser import to_toml
from torchpre.config.validate import validate_config
from torchpre.data.loader import build_dataloader, data_shares, pins_memory
from torchpre.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer
from torchpre.distributed.comm_timer import CommTimer
from torchpre.distributed.elastic import world_sizes_hint
from torchpre.distributed.parallel_dims import ParallelDims
from torchpre.distributed.schedules import bubble_fraction
from torchpre.distributed.utils import (
    apply_comm_timeout,
    configure_flight_recorder,
    configure_float32_matmuls,
    init_distributed,
    select_device,
    set_comm_timeout,
    world_size_from_env,
)
from torchpre.errors import ConfigError
from torchpre.health.forensics import as_metrics, describe, locate_nonfinite, microbatch_samples
from torchpre.health.verdict import LossSpikeDetector, NonFiniteError, StepHealth, StepVerdict, step_verdict
from torchpre.metrics.flops import peak_flops
from torchpre.metrics.logger import MetricsLogger, build_metrics_logger
from torchpre.metrics.memory import max_memory_bytes
from torchpre.metrics.rank_times import StragglerWatch, pipeline_bubble_metrics
from torchpre.metrics.timer import PhaseTimer, StepTimes, tail
from torchpre.models.registry import get_model_spec
from torchpre.optim import build_optimizer
from torchpre.optim.lr_scheduler import build_lr_scheduler
from torchpre.optim.registry import check_config as check_optimizer_config
from torchpre.optim.registry import hyperparameters_from_config
from torchpre.parallel.api import ParallelModel, logits_of, parallelize
from torchpre.parallel.pipeline import PipelinePlan
from torchpre.parallel.tensor_parallel import loss_parallel_context
from torchpre.runtime.determinism import configure_determinism
from torchpre.runtime.garbage_collection import GarbageCollection
from torchpre.runtime.preemption import PreemptionHandler
from torchpre.runtime.profiling import Profiler
from torchpre.training.model import check_layout, meta_model, model_args, parallel_plan
from torchpre.training.validation import Validator, build_validator, held_out_fraction

logger = logging.getLogger("torchpre")

Batch = tuple[torch.Tensor, torch.Tensor]


def resolve_batch_sizes(local_batch_size: int, global_batch_size: int, dp: int) -> tuple[int, int]:
    """(global batch size, gradient-accumulation steps) for `training.global_batch_size`."""
    per_round = local_batch_size * dp
    if global_batch_size == -1:
        return per_round, 1
    if global_batch_size % per_round:
        raise ConfigError(
            f"training.global_batch_size = {global_batch_size} is not divisible by training.local_batch_size x "
            f"data-parallel degree = {local_batch_size} x {dp} = {per_round}. Use a multiple of {per_round} "
            "(or -1 for exactly one microbatch per rank)."
        )
    return global_batch_size, global_batch_size // per_round


@dataclass(frozen=True)
class Runtime:
    """Where this process runs the job: the world torchrun launched (`from_env`), or, for a dry run, one rank of
    a world that exists only in torch's fake process group (`fake`): no peers, collectives that move nothing,
    every tensor on the meta device. The trainer's code path is the same for both, so a dry run meets every
    check a real start-up meets, with the same message."""

    world_size: int
    fake_rank: int | None = None
    data: bool = True  # False: no data loader (a planner's fake ranks: the model and optimizer alone)

    @classmethod
    def from_env(cls) -> "Runtime":
        return cls(world_size_from_env())

    @property
    def fake(self) -> bool:
        return self.fake_rank is not None

    def device(self) -> torch.device:
        return torch.device("meta") if self.fake else select_device()

    def join(self, device: torch.device, timeout_s: float) -> None:
        """Joins the process group: the real one (`init_distributed`), or a fake world of `world_size`."""
        if not self.fake:
            init_distributed(device, timeout_s)
            return
        from torch.testing._internal.distributed.fake_pg import FakeStore

        hook = sys.excepthook  # torch wraps it with a rank prefix per group: one process joins many fake worlds
        dist.init_process_group("fake", store=FakeStore(), rank=self.fake_rank, world_size=self.world_size)
        sys.excepthook = hook


@dataclass
class Interval:
    """What the steps since the last metrics record add up."""

    steps: int = 0
    data_s: float = 0.0  # waiting for batches
    checkpoint_s: float = 0.0  # saves (they happen between steps, so no step time holds them)


@dataclass(frozen=True)
class UnreadStep:
    """A step applied conditionally on the device (`DistributedOptimizer.applies_conditionally`) whose verdict the
    host reads during the next step, with what handling a non-finite verdict then needs."""

    number: int
    verdict: StepVerdict
    grad_norm: torch.Tensor
    microbatches: list[Batch]  # on the device, for the forensics replay
    first_sample: int  # the global sample it started at
    lr_scheduler_state: dict[str, Any]  # before its LR step: the state before it is the last good one


@dataclass(frozen=True)
class RankTimes:
    """One rank's seconds per step over a log interval, gathered from every rank at log steps."""

    busy: float  # step time less time inside collectives: what a straggler has more of
    pipeline_busy: float  # compute of this rank's pipeline stages (0 without a pipeline)
    pipeline_window: float  # the forward-backward phase, the schedule step the bubble is a fraction of


class Trainer:
    """Owns one training job: builds its pieces from a JobConfig, then `train()` runs the steps.

    Everything that can reject the config (values, layout, batch arithmetic, model shapes, pipeline
    schedule, files) runs before the process group is joined, identically on every rank, so bad input
    stops every rank with the same message instead of leaving some waiting for a peer.
    """

    def __init__(self, config: JobConfig, runtime: Runtime | None = None):
        validate_config(config)
        check_optimizer_config(config.optimizer)
        t, p = config.training, config.parallelism
        self.config = config
        self.runtime = runtime = runtime or Runtime.from_env()
        dims = ParallelDims.from_degrees(
            p.data_parallel_degree,
            p.tensor_parallel_degree,
            p.pipeline_parallel_degree,
            runtime.world_size,
            ep=p.expert_parallel_degree,
            dp_replicate=p.data_parallel_replicate_degree,
            dp_shard=p.data_parallel_shard_degree,
        )
        self.parallel_dims = dims
        # The checkpoint a resume will load, found before anything is sized: it may fix the global batch.
        self.resume_dir = (
            find_step_dir(Path(config.job.dump_folder) / config.checkpoint.folder, config.checkpoint.load_step)
            if config.checkpoint.enable
            else None
        )
        self.global_batch_size, self.accumulation_steps = self._batch_sizes(dims.dp)
        self.model_spec = get_model_spec(config.model.name)
        self.tokenizer = Tokenizer(config.model.tokenizer_path or DEFAULT_TOKENIZER_PATH)
        self.model_args = model_args(config, self.tokenizer)
        check_layout(config, self.model_spec, self.model_args, dims)
        self.pipeline = (
            PipelinePlan.from_config(
                p,
                stage_modules=lambda num_stages: self.model_spec.pipeline_stages(
                    self.model_args, num_stages, p.pipeline_parallel_split_points
                ),
                sequences_per_step=t.local_batch_size * self.accumulation_steps,
            )
            if dims.pp > 1
            else None
        )
        # Every optimizer step sees global_batch_size full windows of seq_len labelled tokens.
        self.tokens_per_step = self.global_batch_size * t.seq_len
        # Under loss parallel the logits are a vocab-sharded DTensor handled by loss_parallel's dispatch: eager.
        compile_loss = config.compile.enable and not (p.enable_loss_parallel and dims.tp > 1)
        self._cross_entropy_sum = torch.compile(cross_entropy_sum) if compile_loss else cross_entropy_sum

        configure_determinism(t.deterministic, t.seed)
        self.device = runtime.device()
        configure_float32_matmuls(self.device, t.tf32)
        if self.device.type == "cuda":
            configure_flight_recorder(config.comm.trace_buf_size, Path(config.job.dump_folder) / "comm_traces")
        runtime.join(self.device, config.comm.init_timeout_seconds)  # comm.timeout_seconds after the first step
        mesh_device = "cpu" if runtime.fake else self.device.type
        self.meshes = dims.build_meshes(mesh_device, fsdp=config.optimizer.zero_stage == 3)
        self.mesh, self.expert_mesh = self.meshes.mesh, self.meshes.expert_mesh
        if not runtime.fake:
            apply_comm_timeout(*self.meshes.all())
        self.is_logging_rank = dist.get_rank() == 0
        torch.manual_seed(t.seed)

        self.dataloader = None if not runtime.data else build_dataloader(
            dataset=t.dataset,
            dataset_path=t.dataset_path,
            tokenizer=self.tokenizer,
            seq_len=t.seq_len,
            local_batch_size=t.local_batch_size,
            global_batch_size=self.global_batch_size,
            dp_rank=self.mesh["dp"].get_local_rank(),
            dp_size=dims.dp,
            seed=t.seed,
            dataset_mixture=t.dataset_mixture,
            num_workers=t.num_workers,
            held_out_fraction=held_out_fraction(config.validation),
            vocab_size=self.model_args.vocab_size,
            pin_memory=pins_memory(self.device),
        )
        # Global samples the steps so far trained on: the checkpointed data position. Not the sampler's
        # counter, which runs ahead of training by the batches that loader workers prefetch.
        self.consumed_samples = 0
        self.model = self._build_model()
        self.validator = self._build_validator() if config.validation.enable else None
        o, s = config.optimizer, config.lr_scheduler
        self.optimizer = build_optimizer(
            self.model,
            name=o.name,
            zero_stage=o.zero_stage,
            accumulate_in_fp32=t.mixed_precision_grad == "float32",
            max_norm=t.max_norm,
            bucket_bytes=int(o.bucket_size_mb * 2**20),
            reduce_dtype=getattr(torch, o.reduce_dtype),
            overlap_grad_reduce=o.overlap_grad_reduce,
            zero2_accumulate_locally=o.zero2_accumulate_locally,
            implementation=o.implementation,
            **hyperparameters_from_config(vars(o)),
        )
        self.lr_scheduler = build_lr_scheduler(
            self.optimizer.inner,
            steps=t.steps,
            warmup_steps=s.warmup_steps,
            decay_ratio=s.decay_ratio,
            decay_type=s.decay_type,
            min_lr_factor=s.min_lr_factor,
        )
        self.step = 0
        self.phases = PhaseTimer(self.device)
        self.skipped_steps, self.loss_spikes = 0, 0
        # Non-finite steps replayed to find their origin, and the origin's keys for the step's metrics record.
        self.nonfinite_replays, self.nonfinite_record = 0, {}
        self.unread: UnreadStep | None = None  # the previous step, while its verdict is on its way to the host
        self.stopping = False  # a rank asked to stop (SIGTERM) in a step read late: stop after this one
        self.spike_detector = LossSpikeDetector(t.spike_zscore, t.spike_window) if t.spike_zscore > 0 else None
        self.last_checkpoint_step: int | None = None  # the step of the newest complete checkpoint of this run
        self.checkpoint = self._build_checkpoint_manager()
        self.metrics = None
        if runtime.fake:  # a dry run writes nothing and loads nothing (a load would need the peers' data)
            return
        if self.checkpoint is not None:
            self.checkpoint.remove_unfinished()
        self._save_resolved_config()
        self._maybe_load_checkpoint()
        self.metrics = self._build_metrics_logger() if self.is_logging_rank else None

    def _batch_sizes(self, dp: int) -> tuple[int, int]:
        """`resolve_batch_sizes`, except that a resumed job keeps the global batch its checkpoint was trained
        with when training.global_batch_size is -1 (derived): under another layout -1 would derive another
        batch and silently change the run. An explicit value wins and is logged as a change."""
        t = self.config.training
        saved = saved_global_batch_size(self.resume_dir) if self.resume_dir is not None else 0
        if not saved or t.global_batch_size == saved:
            return self._resolve_batch_sizes(t.global_batch_size, dp)
        if t.global_batch_size != -1:
            logger.info(
                "training.global_batch_size changes from %d (the checkpoint's) to %d at step %s",
                saved, t.global_batch_size, self.resume_dir.name,
            )
            return self._resolve_batch_sizes(t.global_batch_size, dp)
        per_round = t.local_batch_size * dp
        if saved % per_round:
            raise ConfigError(
                f"{self.resume_dir} was trained with a global batch of {saved} sequences, which "
                "training.global_batch_size = -1 keeps on a resume, but that is not divisible by "
                f"training.local_batch_size x data-parallel degree = {t.local_batch_size} x {dp} = {per_round}. "
                f"Choose a local_batch_size that makes {saved} divisible, or set training.global_batch_size to "
                f"change the global batch. {self._world_sizes_hint(saved)}"
            )
        logger.info(
            "global batch %d from the checkpoint (training.global_batch_size = -1 keeps a resumed run's batch): "
            "%d microbatches of %d on each of %d DP ranks",
            saved, saved // per_round, t.local_batch_size, dp,
        )
        return saved, saved // per_round

    def _resolve_batch_sizes(self, global_batch_size: int, dp: int) -> tuple[int, int]:
        """`resolve_batch_sizes`; a global batch this world size cannot split also names the world sizes that can
        (an elastic job re-formed on another number of nodes meets it)."""
        try:
            return resolve_batch_sizes(self.config.training.local_batch_size, global_batch_size, dp)
        except ConfigError as error:
            raise ConfigError(f"{error} {self._world_sizes_hint(global_batch_size)}") from None

    def _world_sizes_hint(self, global_batch_size: int) -> str:
        """`world_sizes_hint` for this job's fixed degrees and a fixed global batch of `global_batch_size`."""
        p, local = self.config.parallelism, self.config.training.local_batch_size
        if global_batch_size % local:
            return ""  # no data-parallel degree splits it: local_batch_size must change, not the world size
        rounds = global_batch_size // local
        return world_sizes_hint(p.tensor_parallel_degree, p.pipeline_parallel_degree, p.expert_parallel_degree, rounds)

    def _layout(self) -> dict[str, int]:
        """This job's layout, as a checkpoint records it (`LAYOUT_KEYS`)."""
        d = self.parallel_dims
        return {
            "world_size": d.world_size, "dp": d.dp, "tp": d.tp, "pp": d.pp, "ep": d.ep,
            "accumulation_steps": self.accumulation_steps,
        }  # fmt: skip

    def _build_checkpoint_manager(self) -> CheckpointManager | None:
        c = self.config.checkpoint
        if not (c.enable or c.initial_load_path):
            return None
        return CheckpointManager(
            folder=Path(self.config.job.dump_folder) / c.folder,
            model_parts=self.model.parts,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            data_position=lambda: self.consumed_samples,
            set_data_position=self._set_data_position,
            global_batch_size=self.global_batch_size,
            layout={key: value for key, value in self._layout().items() if key != "world_size"},
            config_text=to_toml(self.config),
            interval=c.interval,
            keep_latest_k=c.keep_latest_k,
            async_mode=c.async_mode,
            checksums=c.checksums,
            model_only=c.model_only,
            exclude_from_loading=c.exclude_from_loading,
        )

    def _set_data_position(self, position: int) -> None:
        """Resumes the data order at global sample `position` (before the loader is first iterated)."""
        self.dataloader.batch_sampler.load_state_dict({"consumed_samples": position})
        self.consumed_samples = position

    def _maybe_load_checkpoint(self) -> None:
        """Resumes from this job's latest (or chosen) checkpoint, else starts from
        `checkpoint.initial_load_path`'s weights, else from the seed."""
        c = self.config.checkpoint
        step_dir = self.checkpoint.find(c.load_step) if self.checkpoint and c.enable else None
        if step_dir is not None:
            state = self.checkpoint.load(step_dir)
            self.step = self.last_checkpoint_step = state.step
            change = layout_change(state.layout, self._layout(), step_dir, state.step, self.global_batch_size)
            if change is not None and self.is_logging_rank:
                logger.warning(change)
            derived = self.config.training.global_batch_size == -1
            if derived and state.global_batch_size not in (0, self.global_batch_size) and self.is_logging_rank:
                logger.warning(  # the batch was sized from another checkpoint: the latest one, found damaged
                    "%s was trained with a global batch of %d, this job runs %d: set training.global_batch_size = %d "
                    "to continue it unchanged",
                    step_dir, state.global_batch_size, self.global_batch_size, state.global_batch_size,
                )
            if c.load_step != -1:
                self._set_aside_later_checkpoints()
        elif c.initial_load_path:
            self.checkpoint.load(Path(c.initial_load_path), model_only=True)

    def _set_aside_later_checkpoints(self) -> None:
        """A resume from an explicit earlier step starts a new history: the checkpoints after it move to
        `superseded-from-step-N/`, so this run's saves never overwrite them and a restart (load_step -1)
        continues this run rather than the old one."""
        if self.is_logging_rank:
            moved = set_aside_later_steps(self.checkpoint.folder, self.step)
            if moved is not None:
                names = ", ".join(path.name for path in sorted(moved.iterdir()))
                logger.warning(
                    "checkpoint.load_step = %d: moved %s to %s, so that training on from step %d does not "
                    "overwrite them; move them back by hand to resume the earlier run",
                    self.step, names, moved, self.step,
                )
        dist.barrier()

    def _build_model(self) -> ParallelModel:
        """The model, or this rank's pipeline stages of it: built on the meta device in the parameter
        dtype, parallelized, then materialised and initialised from the seed alone (so every layout
        starts equal). When a checkpoint will overwrite the weights, only the buffers it does not hold are
        computed (`ModelSpec.init_buffers`): drawing billions of values to discard them is most of start-up."""
        model = meta_model(self.config, self.model_spec, self.model_args, for_training=True)
        self.num_params = sum(p.numel() for p in model.parameters())
        self.flops_per_token = self.model_spec.flops_per_token(
            self.model_args, self.num_params, self.config.training.seq_len
        )
        seed, source = self.config.training.seed, self._weights_source()
        if source is not None:
            logger.info("skipped weight initialisation: loading %s", source)
        init_weights = (
            self.model_spec.init_buffers if source is not None or self.runtime.fake
            else lambda part: self.model_spec.init_weights(part, seed)
        )
        parallel = parallelize(
            model,
            self.mesh,
            parallel_plan(self.config, self.model_spec, self.model_args, self.pipeline, for_training=True),
            device=self.device,
            init_weights=init_weights,
            loss_fn=self._loss,
            expert_mesh=self.expert_mesh,
            dp_mesh=self.meshes.fsdp_mesh,
            expert_dp_mesh=self.meshes.expert_fsdp_mesh,
        )
        for part in parallel.parts:  # an auxiliary loss (MoE's) is a mean over the global batch's sequences
            self.model_spec.set_aux_loss_scale(part, 1 / self.global_batch_size)
        logger.info(
            "model %s %s: %s parameters, %s FLOPs/token; layout dp %d x tp %d x pp %d (ep %d); "
            "global batch %d = %d microbatches of %d per DP rank",
            self.config.model.name,
            self.config.model.hf_config if self.model_spec.args_from_job else self.config.model.flavor,
            f"{self.num_params:,}",
            f"{self.flops_per_token:,}",
            self.parallel_dims.dp,
            self.parallel_dims.tp,
            self.parallel_dims.pp,
            self.parallel_dims.ep,
            self.global_batch_size,
            self.accumulation_steps,
            self.config.training.local_batch_size,
        )
        if self.pipeline:
            logger.info("pipeline: %s", self.pipeline.describe())
        return parallel

    def _weights_source(self) -> Path | None:
        """The checkpoint `_maybe_load_checkpoint` will load the weights from, if any: the resumed one (unless
        checkpoint.exclude_from_loading names the model), else checkpoint.initial_load_path."""
        c = self.config.checkpoint
        if self.resume_dir is not None:
            return None if "model" in c.exclude_from_loading else self.resume_dir
        return Path(c.initial_load_path) if c.initial_load_path else None

    def _build_validator(self) -> Validator:
        """Evaluates with the training forward (document masks included) or, under PP, with the training
        schedule's forward-only `eval`: both through `ParallelModel.forward_only`, whose losses are `_loss`'s,
        a share of tokens_per_step."""
        return build_validator(
            self.config,
            self.tokenizer,
            self.mesh,
            self.model,
            forward_kwargs=self._forward_kwargs,
            loss_scale=self.tokens_per_step,
            device=self.device,
        )

    def _save_resolved_config(self) -> None:
        """Writes the whole resolved config to the dump folder; the log gets one line saying where."""
        if not self.is_logging_rank:
            return
        folder = Path(self.config.job.dump_folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.toml").write_text(to_toml(self.config), encoding="utf-8")
        source = self.config.job.config_file or "the defaults"
        logger.info("config: %s and the command line; resolved config in %s", source, folder / "config.toml")

    def _build_metrics_logger(self) -> MetricsLogger:
        """A resume appends to metrics.jsonl (a redone step's last record is the one that counts) and continues
        the W&B run and TensorBoard directory; a new run in a folder that holds an earlier run's metrics moves
        them aside, so runs never mix."""
        folder = Path(self.config.job.dump_folder)
        if self.step > 0:
            logger.info("resuming at step %d: appending to %s", self.step, folder / "metrics.jsonl")
        elif moved := set_aside_earlier_metrics(folder):
            logger.warning(
                "job.dump_folder %s already holds metrics of an earlier run (this run resumes no checkpoint): "
                "moved them to %s; this run writes its own. Give each experiment its own job.dump_folder.",
                folder, ", ".join(str(path.relative_to(folder)) for path in moved),
            )
        return build_metrics_logger(self.config, resume_step=self.step)

    def train(self) -> None:
        t = self.config.training
        if self.step >= t.steps:
            self._report_nothing_to_do()
            self._close()
            return
        first_step, start, self.last_loss = self.step, time.perf_counter(), float("nan")
        self.peak = self._peak_flops()
        batches = iter(self.dataloader)
        step_times = StepTimes(self.device)
        traces = Path(self.config.job.dump_folder) / self.config.profiling.save_traces_folder
        profiler = Profiler(self.config.profiling, traces, dist.get_rank(), self.device, first_step=self.step)
        time_collectives = self.config.metrics.time_collectives and dist.get_world_size() > 1
        comm = CommTimer(self.device, self.meshes.all() if time_collectives else [])
        m = self.config.metrics
        self.stragglers = StragglerWatch(m.straggler_threshold, m.straggler_window, self._hosts())
        self.metrics_seconds = 0.0  # what the last record cost to gather and write: outside every step's time
        step_times.start()
        interval = Interval()
        preemption = PreemptionHandler(self.config.checkpoint.save_on_preemption)
        timing = comm.installed() if time_collectives else contextlib.nullcontext()
        with profiler, preemption, timing, GarbageCollection(t.gc_freq) as garbage:
            while self.step < t.steps:
                fetch_start = time.perf_counter()
                with self.phases.phase("data"):
                    microbatches = [next(batches) for _ in range(self.accumulation_steps)]
                interval.data_s += time.perf_counter() - fetch_start
                lr = self.optimizer.inner.param_groups[0]["lr"]
                health, grad_norm = self.train_step(microbatches, stop_requested=preemption.requested)
                step_times.step()
                self.step += 1
                if health is not None:  # None: read during the next step, which is then not a log step
                    self.last_loss = health.loss
                self.consumed_samples += self.global_batch_size
                interval.steps += 1
                garbage.step(self.step)
                profiler.step()
                validate = self.validator is not None and self.validator.due(self.step, t.steps)
                # Some rank got SIGTERM: every rank stops after this step (or after the next, if read late).
                stop = self.stopping or (health is not None and health.stop_requested)
                log = validate or self.step % self.config.metrics.log_freq == 0 or self.step == t.steps or stop
                log = log or bool(self.nonfinite_record)  # the record of a step the forensics replayed
                # The record goes out before the checkpoint: a crash after a save never loses the logged
                # metrics of the step it resumes after.
                if log:  # read before validation and checkpointing, which are not part of a step
                    self._record_interval(interval, step_times, comm, health, grad_norm, lr, validate)
                    interval = Interval()
                if self.config.checkpoint.enable and (self.checkpoint.should_save(self.step, t.steps) or stop):
                    with comm.paused():
                        interval.checkpoint_s += self._save_checkpoint()
                if self.step == first_step + 1:  # start-up, with its compilation and loading, is over
                    with comm.paused():
                        set_comm_timeout(self.config.comm.timeout_seconds, "comm.timeout_seconds")
                if log:
                    step_times.start()
                if stop:
                    self.checkpoint.wait()  # complete on disk before torchrun's shutdown timeout runs out
                    if self.is_logging_rank:
                        logger.warning(
                            "SIGTERM received: stopped after step %d and saved %s (checkpoint.save_on_preemption). "
                            "Run the same command again to resume from it (an elastic torchrun that sent it for a "
                            "node joining restarts the workers itself).",
                            self.step,
                            self.checkpoint.folder / f"step-{self.step}",
                        )
                    break
        self._close()
        self._summarize(self.step - first_step, time.perf_counter() - start)

    def _record_interval(
        self,
        interval: Interval,
        step_times: StepTimes,
        comm: CommTimer,
        health: StepHealth,
        grad_norm: torch.Tensor,
        lr: float,
        validate: bool,
    ) -> None:
        """Reads the interval's timers, validates if due, and writes the record of this step. The record's own
        cost (reading and gathering, not validation) goes into the next record as `time/metrics_s`."""
        record_start = time.perf_counter()
        steps = interval.steps
        durations = step_times.durations()
        step_time = sum(durations) / steps
        phases = self.phases.averages(steps)
        comm_seconds = {kind: total / steps for kind, total in comm.totals().items()}
        timings = {f"time/{name}_s": v for name, v in phases.items()} | tail(durations)
        timings |= {f"time/comm_{kind}_s": comm_seconds[kind] for kind in comm.kinds_in_use}
        if interval.checkpoint_s:
            timings["time/checkpoint_s"] = interval.checkpoint_s
        if self.metrics_seconds:
            timings["time/metrics_s"] = self.metrics_seconds
        rank_times = RankTimes(
            busy=step_time - comm_seconds["total"],
            pipeline_busy=self.model.pipeline_busy_seconds() / steps if self.pipeline else 0.0,
            pipeline_window=phases["forward_backward"],
        )
        with comm.paused():
            self.metrics_seconds = time.perf_counter() - record_start
            val_loss = self.validator.evaluate() if validate else None
            record_start = time.perf_counter()
            self._log(health.loss, grad_norm, lr, step_time, interval.data_s / steps, val_loss, timings, rank_times)
            self.metrics_seconds += time.perf_counter() - record_start

    def _hosts(self) -> list[str]:
        """Every rank's host name, by rank, for the straggler warning."""
        hosts = [""] * dist.get_world_size()
        dist.all_gather_object(hosts, socket.gethostname())
        return hosts

    def _close(self) -> None:
        if self.checkpoint is not None:
            self.checkpoint.close()
        if self.metrics is not None:
            self.metrics.close()

    def _report_nothing_to_do(self) -> None:
        """A rerun of a finished job: says so, and how to train further, instead of exiting silently."""
        steps = self.config.training.steps
        if self.is_logging_rank:
            where = "= training.steps" if self.step == steps else f"past training.steps = {steps}"
            logger.info(
                "already at step %d %s; nothing to do (the checkpoint %s is this run's last). To train further, "
                "raise training.steps (e.g. --training.steps %d; the LR schedule is then laid out over the new "
                "total), or give a new job.dump_folder to start another run.",
                self.step, where, self.checkpoint.folder / f"step-{self.step}", 2 * max(steps, self.step),
            )

    def _summarize(self, steps: int, seconds: float) -> None:
        """One paragraph at the end of a run: what it did and where everything went."""
        if not self.is_logging_rank:
            return
        folder = Path(self.config.job.dump_folder)
        tokens_per_sec = steps * self.tokens_per_step / seconds if seconds > 0 else 0.0
        saved = (
            f"checkpoints in {self.checkpoint.folder} (latest step-{self.last_checkpoint_step})"
            if self.config.checkpoint.enable and self.last_checkpoint_step is not None
            else "no checkpoint (checkpoint.enable is off)"
        )
        logger.info(
            "finished at step %d of %d: %d steps in %.1f s (%s tokens/s), final loss %.4f; metrics in %s, %s, "
            "config in %s",
            self.step, self.config.training.steps, steps, seconds, f"{tokens_per_sec:,.0f}", self.last_loss,
            folder / "metrics.jsonl", saved, folder / "config.toml",
        )

    def _peak_flops(self) -> float:
        """One device's peak FLOP/s: metrics.peak_flops, a GPU's datasheet value, or a matmul measured on each
        rank; the best rank's measurement counts (a rank that measured while its core was busy reads low)."""
        measured = peak_flops(self.device, self.config.metrics.peak_flops)
        peak = torch.tensor(measured, dtype=torch.float64, device=self.device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return float(peak)

    def _mfu(self, achieved_flops: float) -> float:
        """Achieved / peak FLOP/s per device. A measured peak is an estimate: if training itself runs faster,
        that rate is the better bound, so it becomes the peak (said once) and MFU never exceeds 100%."""
        if achieved_flops > self.peak and self.config.metrics.peak_flops <= 0:
            if self.is_logging_rank:
                logger.info(
                    "training reached %.3g FLOP/s per device, above the measured matmul peak of %.3g (the machine was "
                    "busier while it was measured): MFU is computed against %.3g from now on; set metrics.peak_flops "
                    "to fix the peak",
                    achieved_flops, self.peak, achieved_flops,
                )
            self.peak = achieved_flops
        return achieved_flops / self.peak

    def _rank_time_metrics(self, every_rank: list[list[float]]) -> dict[str, float]:
        """The straggler metrics over all ranks (when there are several) and the pipeline bubble of rank 0's
        pipeline (under pipeline parallelism), from every rank's `RankTimes`."""
        metrics = {}
        if len(every_rank) > 1 and self.config.metrics.time_collectives:
            metrics |= self.stragglers.observe([busy for busy, _, _ in every_rank], self.step)
        if self.pipeline is not None:
            p = self.pipeline
            pipeline_ranks = dist.get_process_group_ranks(self.mesh["pp"].get_group())
            metrics |= pipeline_bubble_metrics(
                busy=[every_rank[rank][1] for rank in pipeline_ranks],
                windows=[every_rank[rank][2] for rank in pipeline_ranks],
                theory=bubble_fraction(p.schedule, p.pp, p.n_microbatches, p.stages_per_rank),
            )
        return metrics

    def _loss(self, output: Any, labels: torch.Tensor) -> torch.Tensor:
        """This microbatch's share of the global-batch mean token cross-entropy.

        Summing over tokens and dividing by the global token count (not the microbatch's) makes the
        sum over microbatches, pipeline chunks and DP ranks the exact global mean, for any layout.
        """
        return self._cross_entropy_sum(logits_of(output), labels) / self.tokens_per_step

    def train_step(
        self, microbatches: list[Batch], stop_requested: bool = False
    ) -> tuple[StepHealth | None, torch.Tensor]:
        """One optimizer step over this rank's microbatches; returns (the step's global loss and whether it
        was finite, the global grad norm before clipping). `stop_requested` (this rank got SIGTERM) rides
        the step's all-reduce; the result says whether any rank asked to stop.

        A step whose loss or gradient norm is not finite on any rank is never applied; see `_on_nonfinite`.
        With an optimizer that can skip a step on the device (fused), the update is applied conditionally and,
        unless this step is logged, checkpointed, validated or the last, its verdict is read during the next step
        (`_settle_previous`), after that step's forward and backward are queued: the host then never waits for
        the device to run dry. The result is then (None, grad norm). The LR schedule advances either way, so a
        skipped step shifts nothing after it.
        """
        with self.phases.phase("forward_backward"):  # from pinned memory (pins_memory) the copies do not block
            on_device = [tuple(part.to(self.device, non_blocking=True) for part in batch) for batch in microbatches]
            loss = self._forward_backward(on_device)
        with self.phases.phase("optimizer"):
            if self.unread is not None:
                loss = self._settle_previous(on_device, loss)
            with self.phases.phase("grad_comm"):
                grad_norm = self.optimizer.reduce_gradients()
            verdict = step_verdict(loss, grad_norm, self.parallel_dims.tp, stop_requested)
            if self.optimizer.applies_conditionally:
                self.optimizer.apply(skip=verdict.skip)
                if not self._reads_verdict_now():
                    self.unread = UnreadStep(
                        self.step + 1, verdict, grad_norm, on_device, self.consumed_samples,
                        self.lr_scheduler.state_dict(),
                    )
                    self.lr_scheduler.step()
                    return None, grad_norm
                health = verdict.read()
            else:
                health = verdict.read()
                if health.finite:
                    self.optimizer.apply()
                else:
                    self.optimizer.discard()
            if not health.finite:
                self._on_nonfinite(health, grad_norm, on_device, self.step + 1, self.consumed_samples)
            self.lr_scheduler.step()
        if health.finite and self.spike_detector is not None:
            self._check_spike(health.loss, self.step + 1, self.consumed_samples)
        return health, grad_norm

    def _reads_verdict_now(self) -> bool:
        """Whether the step being taken needs its verdict at its end: it is logged, checkpointed, validated or
        the last, or the job stops after it, or it carries the record of a replayed non-finite step."""
        step, last = self.step + 1, self.config.training.steps
        return (
            step % self.config.metrics.log_freq == 0
            or step == last
            or (self.validator is not None and self.validator.due(step, last))
            or (self.config.checkpoint.enable and self.checkpoint.should_save(step, last))
            or self.stopping
            or bool(self.nonfinite_record)
        )

    def _settle_previous(self, on_device: list[Batch], loss: torch.Tensor) -> torch.Tensor:
        """Reads the previous step's verdict while this step's forward and backward are queued, and handles it as
        `train_step` would have; returns this step's loss share.

        A non-finite previous step was skipped on the device, so this step's gradients were taken on the state
        before it, as they would have been. They are dropped (and this step's forward and backward redone) only
        when the previous step is replayed for forensics, which needs the gradients empty; under
        `on_nonfinite = "stop"` the job saves the state before that step (the host's step, data position and
        LR schedule put back to it) and stops.
        """
        previous, self.unread = self.unread, None
        health = previous.verdict.read()
        self.last_loss = health.loss
        self.stopping = health.stop_requested
        if health.finite:
            if self.spike_detector is not None:
                self._check_spike(health.loss, previous.number, previous.first_sample)
            return loss
        replay = self.nonfinite_replays < self.config.training.nonfinite_forensics
        stop = self.config.training.on_nonfinite == "stop"
        if replay or stop:
            self.optimizer.reduce_gradients()
            self.optimizer.discard()
        if stop:
            self.step, self.consumed_samples = previous.number - 1, previous.first_sample
            self.lr_scheduler.load_state_dict(previous.lr_scheduler_state)
        self._on_nonfinite(health, previous.grad_norm, previous.microbatches, previous.number, previous.first_sample)
        return self._forward_backward(on_device) if replay else loss

    def _forward_backward(self, microbatches: list[Batch]) -> torch.Tensor:
        """Accumulates this rank's gradients over its microbatches; returns its share of the global loss."""
        with loss_parallel_context(self.config.parallelism.enable_loss_parallel and self.parallel_dims.tp > 1):
            return self.model.forward_backward(microbatches, self._forward_kwargs)

    def _batch_samples(self, first_sample: int) -> str:
        """The global sample indices of the step that started at `first_sample`, to find its data again."""
        return f"global samples [{first_sample}, {first_sample + self.global_batch_size})"

    def _on_nonfinite(
        self, health: StepHealth, grad_norm: torch.Tensor, microbatches: list[Batch], step: int, first_sample: int
    ) -> None:
        """Handles step `step` (from global sample `first_sample`), which was not applied: counts it (`skip`) or
        saves the last good state and stops (`stop`).

        Every rank reaches the same verdict (the flags were all-reduced), so all of them skip, or all of
        them save and raise together; before that they replay the step to say where it went non-finite.
        """
        what = health.describe_nonfinite()
        values = f"loss {health.loss}, gradient norm {grad_norm.item()}"
        origin = self._locate_nonfinite(microbatches, step, first_sample)
        if self.config.training.on_nonfinite == "skip":
            self.skipped_steps += 1
            if self.is_logging_rank:
                logger.warning(
                    "step %d: %s is not finite (%s) on %s; the update was skipped (%d skipped steps so far).%s",
                    step, what, values, self._batch_samples(first_sample), self.skipped_steps, origin,
                )
            return
        raise NonFiniteError(
            f"step {step}: {what} is not finite ({values}) on {self._batch_samples(first_sample)}, so the update "
            f"was not applied and training stopped (training.on_nonfinite = 'stop').{origin} "
            f"{self._save_last_good_state()} Lower "
            "optimizer.lr or raise lr_scheduler.warmup_steps, check that batch's data, or set "
            "training.on_nonfinite = 'skip' to drop such steps and train on."
        )

    def _locate_nonfinite(self, microbatches: list[Batch], step: int, first_sample: int) -> str:
        """For the first `training.nonfinite_forensics` non-finite steps: replays the step's forward and backward
        on its `microbatches` (already on the device) with a check on every module (`torchpre.health.forensics`), keeps
        the origin for the step's metrics record (`nonfinite_record`) and returns a sentence naming it (" "
        first), else "". Costs one step's compute.

        The replay's gradients go through `reduce_gradients()` like a step's, so every data-parallel reduction
        the replay's backward started completes and the buckets reset; `discard()` then drops them.
        """
        if self.nonfinite_replays >= self.config.training.nonfinite_forensics:
            return ""
        self.nonfinite_replays += 1
        dp_rank = self.mesh["dp"].get_local_rank()
        finding = locate_nonfinite(
            self.model.parts, self.model.stage_ids, dp_rank,
            lambda: self._forward_backward(microbatches),
        )
        self.optimizer.reduce_gradients()
        self.optimizer.discard()
        self.nonfinite_record = {"nonfinite/step": step} | as_metrics(finding)
        if finding is None:
            return " " + describe(None, [])
        local = self.config.training.local_batch_size
        rows = local * self.accumulation_steps // self.pipeline.n_microbatches if self.pipeline else local
        samples = microbatch_samples(
            first_sample, local, self.parallel_dims.dp, finding.dp_rank, rows, finding.microbatch
        )
        return " " + describe(finding, samples)

    def _save_last_good_state(self) -> str:
        """Checkpoints the state before the failed step (unless that step is saved already); says where."""
        if not self.config.checkpoint.enable:
            return "Checkpointing is off (checkpoint.enable), so nothing was saved."
        if self.last_checkpoint_step != self.step:
            self._save_checkpoint()
        self.checkpoint.wait()
        return f"The last good state (step {self.step}) is saved in {self.checkpoint.folder / f'step-{self.step}'}."

    def _save_checkpoint(self) -> float:
        """Saves step-N of the current state; returns the seconds training waited for it (perf_counter: a
        save blocks the host until the state is on the host side, so host time is the cost)."""
        start = time.perf_counter()
        self.checkpoint.save(self.step)
        self.last_checkpoint_step = self.step
        return time.perf_counter() - start

    def _check_spike(self, loss: float, step: int, first_sample: int) -> None:
        zscore = self.spike_detector.check(loss)
        if zscore is None:
            return
        self.loss_spikes += 1
        if self.is_logging_rank:
            logger.warning(
                "step %d: loss spike: %.4f is %.1f standard deviations above the mean of the last %d losses, on %s",
                step, loss, zscore, self.config.training.spike_window, self._batch_samples(first_sample),
            )

    def _forward_kwargs(self, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """Under training.document_mask, `document_ids`: each position's document in the packed rows. A new
        one starts at every BOS token (positions before a row's first BOS end a document begun in an earlier
        row)."""
        if not self.config.training.document_mask:
            return {}
        return {"document_ids": (inputs == self.tokenizer.bos_id).cumsum(dim=1)}

    def _log(
        self,
        loss: float,
        grad_norm: torch.Tensor,
        lr: float,
        step_time: float,
        data_time: float,
        val_loss: float | None,
        timings: dict[str, float],
        rank_times: RankTimes,
    ) -> None:
        """Gathers the per-rank maxima and times; rank 0 writes the record (`loss` is already global, see
        step_verdict)."""
        o = self.optimizer
        maxima = torch.tensor(
            [max_memory_bytes(self.device), o.state_bytes(), o.param_bytes(), o.grad_bytes()],
            dtype=torch.float64,
            device=self.device,
        )
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        mine = torch.tensor(astuple(rank_times), dtype=torch.float64, device=self.device)
        every_rank = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every_rank, mine)
        extra = self.model_spec.extra_metrics(self.model.parts, self.model_args, self.device)
        nonfinite, self.nonfinite_record = self.nonfinite_record, {}
        if self.metrics is None:
            return
        extra |= self._rank_time_metrics(torch.stack(every_rank).tolist())
        tokens_per_sec = self.tokens_per_step / step_time
        world_size = self.parallel_dims.world_size
        mfu = self._mfu(self.flops_per_token * tokens_per_sec / world_size)
        self.metrics.log(
            {
                "step": self.step,
                "loss": loss,
                "lr": lr,
                "grad_norm": grad_norm.item(),
                "tokens_per_sec": tokens_per_sec,
                "tokens_per_sec_per_device": tokens_per_sec / world_size,
                "samples_per_sec": self.global_batch_size / step_time,
                "mfu": mfu,
                "step_time_s": step_time,
                "data_time_s": data_time,
                "max_memory_bytes": int(maxima[0]),
                "optimizer_state_bytes": int(maxima[1]),
                "param_bytes": int(maxima[2]),
                "grad_bytes": int(maxima[3]),
                **timings,
                **extra,
                "skipped_steps": self.skipped_steps,
                "loss_spikes": self.loss_spikes,
                **data_shares(self.dataloader, self.consumed_samples),
                **({"val_loss": val_loss} if val_loss is not None else {}),
                **nonfinite,
            }
        )


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy, computed in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")

