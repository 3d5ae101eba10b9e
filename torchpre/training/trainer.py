"""The training loop. It only sequences the job's components (`torchpre.training.job`), each of which owns its
state: data -> forward/backward (a pipeline schedule or plain) -> gradient reduction -> step guard -> optimizer and
LR step -> evaluation and metrics -> checkpoint -> Hugging Face export."""

import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist

from torchpre.assembly.weights import DcpFolder, HfFolder, Resume
from torchpre.checkpoint.layout import layout_change, stage_change
from torchpre.config.job_config import JobConfig
from torchpre.distributed.process_groups import set_comm_timeout
from torchpre.health.guard import Batch, TakenStep
from torchpre.health.verdict import StepHealth
from torchpre.interchange.load import HFWeights, LoadReport, load_hf_weights, log_reports
from torchpre.parallel.tensor_parallel import loss_parallel_context
from torchpre.runtime.garbage_collection import GarbageCollection
from torchpre.runtime.preemption import PreemptionHandler, leave_stop_note
from torchpre.runtime.profiling import Profiler
from torchpre.runtime.world import Runtime
from torchpre.training.batches import kept_global_batch
from torchpre.training.job import build_job
from torchpre.training.run_folder import (
    check_run_folder,
    open_metrics,
    save_resolved_config,
    set_aside_later_history,
)
from torchpre.training.stages import saved_stages, stages_change

logger = logging.getLogger("torchpre")


class Trainer:
    """One training job: `Trainer(config)` builds its components (`build_job`) and resumes it (its latest or chosen
    checkpoint, else `checkpoint.initial_load_path`'s weights, else the seed); `train()` runs the steps. A dry run's
    fake rank (`Runtime.fake`) is built the same way and neither writes nor loads anything."""

    def __init__(self, config: JobConfig, runtime: Runtime | None = None):
        self.config = config
        check_run_folder(config)  # before anything in it is read (a resume's batch) or written
        self.job = job = build_job(config, runtime or Runtime.from_env())
        self.last_checkpoint_step: int | None = None  # the step of the newest complete checkpoint of this run
        self.hf_load_report: LoadReport | None = None  # this rank's load of a Hugging Face folder, if it loaded one
        self.preemption = PreemptionHandler(config.checkpoint.save_on_preemption)
        if job.runtime.fake:
            return
        if job.checkpoint is not None:
            job.checkpoint.remove_unfinished()
        if job.hf_export is not None:
            job.hf_export.remove_unfinished()
        save_resolved_config(config)
        if job.is_logging_rank:
            for warning in job.preflight.plan.warnings(config.training.steps):
                logger.warning(warning)
        start = time.perf_counter()
        self._resume()
        if job.is_logging_rank and self.step > 0:
            logger.info("restored the state of step %d in %.2f s", self.step, time.perf_counter() - start)
        if job.is_logging_rank:
            job.metrics.sink = open_metrics(config, resume_step=job.progress.step)

    @property
    def step(self) -> int:
        return self.job.progress.step

    def train(self) -> None:
        job, t = self.job, self.config.training
        if self.step >= t.steps:
            self._report_nothing_to_do()
            self._close()
            return
        first_step, start = self.step, time.perf_counter()
        traces = Path(self.config.job.dump_folder) / self.config.profiling.save_traces_folder
        profiler = Profiler(self.config.profiling, traces, dist.get_rank(), job.device, first_step=first_step)
        preemption = self.preemption
        with job.metrics.measuring() as metrics, profiler, preemption, GarbageCollection(t.gc_freq) as garbage:
            while self.step < t.steps:
                job.begin_step()  # a ramp's global batch, a data stage
                fetch_start = time.perf_counter()
                with metrics.phase("data"):
                    microbatches = job.data.next_step()
                metrics.data_wait(time.perf_counter() - fetch_start)
                lr = job.optimizer.lr
                # A background save that failed stops every rank after this step, as SIGTERM does; the save that
                # follows raises its error on all of them.
                stop = preemption.requested or (job.checkpoint is not None and job.checkpoint.failed)
                health, grad_norm = self.train_step(microbatches, stop_requested=stop)
                metrics.step_done()
                job.progress.step += 1
                job.data.step_done()
                garbage.step(self.step)
                profiler.step()
                if self._after_step(health, grad_norm, lr, first_step):
                    break
        self._close()
        self._summarize(self.step - first_step, time.perf_counter() - start)

    def train_step(
        self, microbatches: list[Batch], stop_requested: bool = False
    ) -> tuple[StepHealth | None, torch.Tensor]:
        """One optimizer step over this rank's microbatches; returns the step's health (global loss, finite or not,
        stop requested by any rank) and the global gradient norm before clipping. The health is None when the
        step guard reads its verdict during the next step (`StepGuard`); the LR schedule advances either way, so a
        skipped step shifts nothing after it. `stop_requested`: this rank got SIGTERM."""
        job = self.job
        with job.metrics.phase("forward_backward"):  # from pinned memory (pins_memory) the copies do not block
            on_device = [tuple(part.to(job.device, non_blocking=True) for part in batch) for batch in microbatches]
            if job.context_parallel is not None:  # each cp rank keeps its positions of the sequences
                on_device = [job.context_parallel.shard(batch) for batch in on_device]
            loss = self.forward_backward(on_device)
        with job.metrics.phase("optimizer"):
            loss = job.guard.settle_previous(loss, on_device, self)
            with job.metrics.phase("grad_comm"):
                grad_norm = job.optimizer.clip_(job.reduction.reduce())
            read_now = self._reads_verdict_now()
            deferred = job.optimizer.applies_conditionally and not read_now
            lr_state = job.lr_scheduler.state_dict() if deferred else {}
            step = TakenStep(self.step + 1, job.data.consumed_samples, on_device, grad_norm, lr_state)
            health = job.guard.apply(loss, step, self, stop_requested=stop_requested, read_now=read_now)
            job.lr_scheduler.step()
        return health, grad_norm

    def _after_step(self, health: StepHealth | None, grad_norm: torch.Tensor, lr: float, first_step: int) -> bool:
        """Evaluation and the metrics record if due, a checkpoint and a Hugging Face export if due; True when every
        rank stops here (some rank got SIGTERM: after this step, or after the next when this one was read late)."""
        job, t, step = self.job, self.config.training, self.step
        evaluate = job.evaluations.due(step, t.steps)
        stop = job.guard.stopping or (health is not None and health.stop_requested)
        log = evaluate or step % self.config.metrics.log_freq == 0 or step == t.steps or stop or job.guard.has_findings
        # The record goes out before the checkpoint: a crash after a save never loses the logged metrics of the
        # step it resumes after.
        if log:
            self._record(health, grad_norm, lr, evaluate)
        if self.config.checkpoint.enable and (job.checkpoint.should_save(step, t.steps) or stop):
            with job.metrics.paused():
                job.metrics.checkpoint_wait(self._save_checkpoint())
        if job.snapshots is not None and job.snapshots.due(step, t.steps) and not stop:
            with job.metrics.paused():  # the time it blocks is its own record, snapshot/blocked_s
                job.snapshots.save(step)
        if job.hf_export is not None and job.hf_export.due(step, t.steps):
            with job.metrics.paused():
                job.hf_export.export(step)
        if step == first_step + 1:  # start-up, with its compilation and loading, is over
            with job.metrics.paused():
                set_comm_timeout(self.config.comm.timeout_seconds, "comm.timeout_seconds")
        if log:
            job.metrics.restart_interval()
        if stop:
            job.checkpoint.wait()  # complete on disk before torchrun's shutdown timeout runs out
            leave_stop_note(step)
            if job.is_logging_rank:
                saved = self.last_checkpoint_step == step
                logger.warning(
                    "%s received: stopped after step %d and %s (checkpoint.save_on_preemption). Run the same "
                    "command again to resume from %s (an elastic torchrun that sent SIGTERM for a node joining "
                    "restarts the workers itself; multinode.slurm requeues itself on Slurm's SIGUSR1).",
                    self.preemption.received or "SIGTERM or SIGUSR1 (by another rank)",
                    step,
                    f"saved {job.checkpoint.folder / f'step-{step}'}" if saved else "skipped its save (no room)",
                    "it" if saved else "the latest checkpoint",
                )
        return stop

    def _reads_verdict_now(self) -> bool:
        """Whether the step being taken needs its verdict at its end: it is logged, checkpointed, exported, evaluated
        or the last, or the job stops after it, or it carries the record of a replayed non-finite step."""
        job, step, last = self.job, self.step + 1, self.config.training.steps
        return (
            step % self.config.metrics.log_freq == 0
            or step == last
            or job.evaluations.due(step, last)
            or (self.config.checkpoint.enable and job.checkpoint.should_save(step, last))
            or (job.snapshots is not None and job.snapshots.due(step, last))  # never a state the guard may undo
            or (job.hf_export is not None and job.hf_export.due(step, last))
            or job.guard.stopping
            or job.guard.has_findings
        )

    # What the step guard asks of the loop (`GuardedLoop`) ------------------------------------------------------

    def forward_backward(self, microbatches: list[Batch]) -> torch.Tensor:
        """Accumulates this rank's gradients over its microbatches; returns its share of the global loss."""
        job = self.job
        with loss_parallel_context(self.config.parallelism.enable_loss_parallel and job.dims.tp > 1):
            return job.model.forward_backward(microbatches, job.forward_inputs)

    def drop_gradients(self) -> None:
        self.job.reduction.reduce()
        self.job.guard.optimizer.discard()  # the step as the guard takes it: the model's step statistics go too

    def rewind(self, step: TakenStep) -> None:
        self.job.progress.step, self.job.data.consumed_samples = step.number - 1, step.first_sample
        self.job.lr_scheduler.load_state_dict(step.lr_scheduler_state)

    def save_last_good_state(self) -> str:
        """Checkpoints the state before the failed step (unless that step is saved already); says where."""
        if not self.config.checkpoint.enable:
            return "Checkpointing is off (checkpoint.enable), so nothing was saved."
        if self.last_checkpoint_step != self.step:
            self._save_checkpoint()
        self.job.checkpoint.wait()
        if self.last_checkpoint_step != self.step:
            return f"The last good state (step {self.step}) was not saved: see checkpoint.on_low_space's error above."
        return f"The last good state (step {self.step}) is saved in {self.job.checkpoint.folder / f'step-{self.step}'}."

    # --------------------------------------------------------------------------------------------------------------

    def _record(self, health: StepHealth, grad_norm: torch.Tensor, lr: float, evaluate: bool) -> None:
        """The metrics record of this step (`loss` is already global, see `step_verdict`), with the results of the
        evaluations due when `evaluate`."""
        job = self.job
        optimizer, spec = job.optimizer, job.preflight.model_spec
        job.metrics.record(
            self.step,
            {"loss": health.loss, "lr": lr, "grad_norm": grad_norm},
            {
                "optimizer_state_bytes": optimizer.state_bytes(),
                "param_bytes": optimizer.param_bytes(),
                "grad_bytes": optimizer.grad_bytes(),
                **({"optimizer_sent_bytes": optimizer.sent_bytes()} if optimizer.assembles_matrices else {}),
            },
            extra=lambda: (
                spec.hooks.extra_metrics(job.model.parts, job.preflight.model_args, job.device)
                | job.guard.metrics()
                | job.data.shares()
                | ({"data_stage": job.shape.stage.index + 1} if len(job.preflight.plan.stages.stages) > 1 else {})
                | (job.checkpoint.metrics() if job.checkpoint is not None else {})
                | (job.snapshots.metrics() if job.snapshots is not None else {})
            ),
            evaluate=(lambda: job.evaluations.run(self.step, self.config.training.steps)) if evaluate else None,
        )

    def _save_checkpoint(self) -> float:
        """Saves step-N of the current state (unless checkpoint.on_low_space skips it); returns the seconds training
        waited for it (perf_counter: a save blocks the host until the state is on the host side, so host time is
        the cost)."""
        start = time.perf_counter()
        if self.job.checkpoint.save(self.step):
            self.last_checkpoint_step = self.step
        return time.perf_counter() - start

    def _resume(self) -> None:
        """Loads where preflight found the weights come from (`Preflight.weights`): this job's checkpoint (the step
        preflight found, unless the whole-folder check at load finds a latest one damaged: `resume_step`), else
        `checkpoint.initial_load_path`'s weights, else nothing (the seed). In-memory snapshots newer than that
        checkpoint take precedence over all of them."""
        job, c = self.job, self.config.checkpoint
        if self._resume_from_snapshots():
            return
        source = job.preflight.weights
        if isinstance(source, HfFolder):
            self._load_hf(source.weights)
        elif isinstance(source, DcpFolder):
            job.checkpoint.load(source.folder, weights_only=True)
        if not isinstance(source, Resume):
            return
        step_dir = job.checkpoint.resume_step(source.step_dir, source.latest)
        job.checkpoint.load(step_dir)
        job.begin_step(resumed=True)  # the resumed step's global batch and data stage, which the messages below compare
        progress, global_batch_size = job.progress, job.batches.global_batch_size
        self.last_checkpoint_step = progress.step
        change = layout_change(progress.saved_layout, progress.layout, step_dir, progress.step, global_batch_size)
        if change is not None and job.is_logging_rank:
            logger.warning(change)
        t = self.config.training
        stage = stage_change(progress.saved, progress.layout, global_batch_size, progress.step, t.global_batch_unit)
        if stage is not None and job.is_logging_rank:
            logger.warning(stage)
        saved_batch = int(progress.saved.get("global_batch_size", 0))
        saved_seq_len = int(progress.saved.get("seq_len", t.seq_len))
        kept = kept_global_batch(saved_batch, saved_seq_len, t.seq_len, t.global_batch_unit) or saved_batch
        base = job.preflight.batches.global_batch_size  # in sequences of training.seq_len, as `kept`
        if t.global_batch_size == -1 and kept not in (0, base) and job.is_logging_rank:
            logger.warning(  # the batch was sized from another checkpoint: the latest one, found damaged
                "%s was trained with a global batch of %d, this job runs %d: set training.global_batch_size = %d "
                "to continue it unchanged",
                step_dir, saved_batch, base, kept,
            )
        self._compare_stages(step_dir)
        if c.load_step != -1:
            set_aside_later_history(self.config, job.checkpoint.folder, progress.step)

    def _resume_from_snapshots(self) -> bool:
        """Resumes from the in-memory snapshots (checkpoint.memory_interval) when every rank has one of a step newer
        than the disk checkpoint preflight found; False (on every rank) when the disk checkpoint is the one to resume
        from, or when checkpoint.load_step chose one. The snapshots' step is chosen here, not by preflight: the ranks
        agree on it over the process group, from each one's listing of its own folder and its peer's replicas."""
        job, c = self.job, self.config.checkpoint
        if job.snapshots is None or c.load_step != -1:
            return False
        source = job.preflight.weights
        on_disk = source.step if isinstance(source, Resume) else None  # the newest complete step, preflight's
        restored = job.snapshots.restore(on_disk or 0, c.exclude_from_loading)
        if restored is None:
            return False
        self.last_checkpoint_step = on_disk
        job.begin_step(resumed=True)
        self._compare_stages(job.snapshots.folder)
        return True

    def _load_hf(self, weights: HFWeights) -> None:
        """The model's weights from a Hugging Face folder, each rank reading the shards it holds, into the fp32
        masters (as a checkpoint's load does), then the parameters; the memory it took is logged."""
        model = self.job.checkpoint_components()["model"]
        targets = model.load_targets(set())
        self.hf_load_report = load_hf_weights(weights, targets)
        model.load_state_dict(targets)
        log_reports(weights.folder.folder, self.hf_load_report)

    def _compare_stages(self, step_dir: Path) -> None:
        """Says what a resume changes of the data stages (`stages_change`): a warning for steps already taken. The
        saved stages are data of the checkpoint's state (`TrainProgress`), never read from its config.toml."""
        job = self.job
        saved = saved_stages(job.progress.saved_stages, step_dir)
        if not job.is_logging_rank:
            return
        if saved is None:
            logger.info("%s records no data stages (it was saved before they were): this resume does not compare "
                        "them with training.data_stages", step_dir)  # fmt: skip
            return
        warnings, notes = stages_change(saved, job.preflight.plan.stages, self.step, self.config.training.steps)
        for line in warnings:
            logger.warning(line)
        for line in notes:
            logger.info(line)

    def _close(self) -> None:
        if self.job.checkpoint is not None:
            self.job.checkpoint.close()
        if self.job.snapshots is not None:  # a run that ended normally removes its snapshots
            self.job.snapshots.close(finished=self.step >= self.config.training.steps)
        if self.job.hf_export is not None:
            self.job.hf_export.close()
        self.job.metrics.close()

    def _report_nothing_to_do(self) -> None:
        """A rerun of a finished job: says so, and how to train further, instead of exiting silently."""
        steps = self.config.training.steps
        if self.job.is_logging_rank:
            where = "= training.steps" if self.step == steps else f"past training.steps = {steps}"
            logger.info(
                "already at step %d %s; nothing to do (the checkpoint %s is this run's last). To train further, "
                "raise training.steps (e.g. --training.steps %d; the LR schedule is then laid out over the new "
                "total), or give a new job.dump_folder to start another run.",
                self.step, where, self.job.checkpoint.folder / f"step-{self.step}", 2 * max(steps, self.step),
            )

    def _summarize(self, steps: int, seconds: float) -> None:
        """One paragraph at the end of a run: what it did and where everything went."""
        if not self.job.is_logging_rank:
            return
        folder = Path(self.config.job.dump_folder)
        tokens_per_sec = steps * self.job.batches.tokens_per_step / seconds if seconds > 0 else 0.0
        saved = (
            f"checkpoints in {self.job.checkpoint.folder} (latest step-{self.last_checkpoint_step})"
            if self.config.checkpoint.enable and self.last_checkpoint_step is not None
            else "no checkpoint (checkpoint.enable is off)"
        )
        logger.info(
            "finished at step %d of %d: %d steps in %.1f s (%s tokens/s), final loss %.4f; metrics in %s, %s, "
            "config in %s",
            self.step, self.config.training.steps, steps, seconds, f"{tokens_per_sec:,.0f}", self.job.guard.last_loss,
            folder / "metrics.jsonl", saved, folder / "config.toml",
        )
