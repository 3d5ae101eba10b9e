"""The step guard: every step's job-wide verdict, and what a step whose loss or gradient norm is not finite does.

A non-finite step is never applied. Under `training.on_nonfinite = "skip"` it is dropped and counted; under
"stop" the state before it is saved and the job stops with `NonFiniteError`. Before either, the first
`training.nonfinite_forensics` such steps are replayed with a check on every module (`Forensics`), which names
where the NaN/inf started. Finite losses feed the loss-spike detector (`training.spike_zscore`).

With an optimizer that can skip a step on the device (torch's fused ones), the update is applied conditionally
and, unless the caller needs the verdict at once (a step that is logged, checkpointed, validated or the last), it
is read during the next step (`settle_previous`), after that step's forward and backward are queued: the host then
never waits for the device to run dry. A non-finite verdict read late is handled exactly: a skipped step left the
state as it was, so the next step's gradients, taken on that state, are kept; a forensic replay needs the
gradients empty, so it drops them and the next step's forward and backward are redone; a stop puts the loop's step,
data position and LR schedule back to before the failed step (`GuardedLoop.rewind`) and saves that state.

The guard needs of the training loop only what `GuardedLoop` names, so it is tested without a Trainer.
"""

import logging
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from torchpre.config.job_config import Training
from torchpre.health.forensics import Forensics
from torchpre.health.spikes import LossSpikeDetector
from torchpre.health.verdict import NonFiniteError, StepHealth, StepVerdict, step_verdict
from torchpre.step_rules.batch import CurrentBatch

logger = logging.getLogger("torchpre")

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class TakenStep:
    """One optimizer step, as the guard may need it after its verdict: its `number` (1-based), the global sample
    it started at, its microbatches (on the device, for a forensic replay), its gradient norm and the LR
    scheduler's state before its LR step (the state before the step is the last good one)."""

    number: int
    first_sample: int
    microbatches: list[Batch]
    grad_norm: torch.Tensor
    lr_scheduler_state: dict[str, Any]


class StepOptimizer(Protocol):
    """What the guard asks of the optimizer (`torchpre.optim.DistributedOptimizer`)."""

    @property
    def applies_conditionally(self) -> bool: ...

    def apply(self, skip: torch.Tensor | None = None) -> None: ...

    def discard(self) -> None: ...


class GuardedLoop(Protocol):
    """What the guard asks of the training loop."""

    def forward_backward(self, microbatches: list[Batch]) -> torch.Tensor:
        """Accumulates the gradients of `microbatches`; returns this rank's share of the step's loss."""

    def drop_gradients(self) -> None:
        """Ends the gradient reduction a backward started and drops the gradients (parameters unchanged)."""

    def rewind(self, step: TakenStep) -> None:
        """Puts the loop's step counter, data position and LR schedule back to just before `step`."""

    def save_last_good_state(self) -> str:
        """Checkpoints the current state (if checkpointing is on); returns a sentence saying where."""


class StepGuard:
    """Decides, applies and counts each step's verdict; see the module docstring. `settings` is the job's [training]
    section (on_nonfinite, nonfinite_forensics, spike_zscore, spike_window); the `batch`'s global size names a
    step's samples in messages. Its `state_dict` is the counters a resumed run continues."""

    def __init__(
        self,
        settings: Training,
        optimizer: StepOptimizer,
        forensics: Forensics,
        *,
        tp_degree: int,
        batch: CurrentBatch,
        is_logging_rank: bool,
    ):
        self.on_nonfinite, self.forensics_budget = settings.on_nonfinite, settings.nonfinite_forensics
        self.spike_window = settings.spike_window
        self.spikes = LossSpikeDetector(settings.spike_zscore, settings.spike_window) if settings.spike_zscore else None
        self.optimizer, self.forensics = optimizer, forensics
        self.tp_degree, self.batch = tp_degree, batch
        self.is_logging_rank = is_logging_rank
        self.skipped_steps = self.loss_spikes = self.replays = 0
        self.record: dict[str, Any] = {}  # the nonfinite/* keys of a replayed step, for its metrics record
        self.unread: tuple[TakenStep, StepVerdict] | None = None  # the previous step, verdict on its way to the host
        self.stopping = False  # a rank asked to stop (SIGTERM) in a step read late: stop after the current one
        self.last_loss = float("nan")  # the global loss of the last step whose verdict was read

    def state_dict(self) -> dict[str, int]:
        return {"skipped_steps": self.skipped_steps, "loss_spikes": self.loss_spikes, "nonfinite_replays": self.replays}

    def load_targets(self, saved: set[str]) -> dict[str, int]:
        """The counters the checkpoint holds (none in one written before the guard saved them: they restart)."""
        return {key: value for key, value in self.state_dict().items() if f"health.{key}" in saved}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.skipped_steps = int(state_dict.get("skipped_steps", self.skipped_steps))
        self.loss_spikes = int(state_dict.get("loss_spikes", self.loss_spikes))
        self.replays = int(state_dict.get("nonfinite_replays", self.replays))

    def metrics(self) -> dict[str, Any]:
        """The counters and a replayed step's findings, for a metrics record (the findings once)."""
        record, self.record = self.record, {}
        return {"skipped_steps": self.skipped_steps, "loss_spikes": self.loss_spikes, **record}

    @property
    def has_findings(self) -> bool:
        """A replayed step's findings wait for a metrics record."""
        return bool(self.record)

    def settle_previous(self, loss: torch.Tensor, microbatches: list[Batch], loop: GuardedLoop) -> torch.Tensor:
        """Reads the previous step's verdict, if it was left unread, while this step's forward and backward (of
        `microbatches`, whose loss share is `loss`) are queued, and handles it as `apply` would have; returns this
        step's loss share (recomputed when a replay dropped this step's gradients)."""
        if self.unread is None:
            return loss
        (previous, verdict), self.unread = self.unread, None
        health = verdict.read()
        self.last_loss, self.stopping = health.loss, health.stop_requested
        if health.finite:
            self._check_spike(health.loss, previous)
            return loss
        replay = self.replays < self.forensics_budget
        stop = self.on_nonfinite == "stop"
        if replay or stop:
            loop.drop_gradients()
        if stop:
            loop.rewind(previous)
        self._on_nonfinite(health, previous, loop)
        return loop.forward_backward(microbatches) if replay else loss

    def apply(
        self, loss: torch.Tensor, step: TakenStep, loop: GuardedLoop, *, stop_requested: bool, read_now: bool
    ) -> StepHealth | None:
        """Decides the verdict of `step` (this rank's loss share `loss`; `stop_requested`: this rank got SIGTERM,
        which rides the verdict's all-reduce) and applies the update if it is finite. Returns the step's health,
        or None when it is left unread until the next step (`read_now` false, conditional optimizer)."""
        verdict = step_verdict(loss, step.grad_norm, self.tp_degree, stop_requested)
        if self.optimizer.applies_conditionally:
            self.optimizer.apply(skip=verdict.skip)
            if not read_now:
                self.unread = (step, verdict)
                return None
            health = verdict.read()
        else:
            health = verdict.read()
            if health.finite:
                self.optimizer.apply()
            else:
                self.optimizer.discard()
        self.last_loss = health.loss
        if not health.finite:
            self._on_nonfinite(health, step, loop)
        else:
            self._check_spike(health.loss, step)
        return health

    def _samples(self, step: TakenStep) -> str:
        """The global sample indices of `step`, to find its data again."""
        return f"global samples [{step.first_sample}, {step.first_sample + self.batch.sizes.global_batch_size})"

    def _on_nonfinite(self, health: StepHealth, step: TakenStep, loop: GuardedLoop) -> None:
        """Counts `step`, which was not applied (`skip`), or saves the last good state and stops (`stop`).

        Every rank reaches the same verdict (the flags were all-reduced), so all of them skip, or all of
        them save and raise together; before that they replay the step to say where it went non-finite.
        """
        what = health.describe_nonfinite()
        values = f"loss {health.loss}, gradient norm {step.grad_norm.item()}"
        replays_before = self.replays
        origin = self._locate(step, loop)
        if self.on_nonfinite == "skip":
            self.skipped_steps += 1
            if self.is_logging_rank:
                logger.warning(
                    "step %d: %s is not finite (%s) on %s; the update was skipped (%d skipped steps so far).%s",
                    step.number, what, values, self._samples(step), self.skipped_steps, origin,
                )
            return
        self.replays = replays_before  # the state saved is the one before the failed step, this counter too
        raise NonFiniteError(
            f"step {step.number}: {what} is not finite ({values}) on {self._samples(step)}, so the update "
            f"was not applied and training stopped (training.on_nonfinite = 'stop').{origin} "
            f"{loop.save_last_good_state()} Lower "
            "optimizer.lr or raise lr_scheduler.warmup_steps, check that batch's data, or set "
            "training.on_nonfinite = 'skip' to drop such steps and train on."
        )

    def _locate(self, step: TakenStep, loop: GuardedLoop) -> str:
        """For the first `training.nonfinite_forensics` non-finite steps: replays `step`'s forward and backward on
        its microbatches (already on the device) with a check on every module, keeps the origin for the step's
        metrics record and returns a sentence naming it (" " first), else "". Costs one step's compute.

        The replay's gradients go through `drop_gradients()` like a step's, so every data-parallel reduction the
        replay's backward started completes and the buckets reset before they are dropped.
        """
        if self.replays >= self.forensics_budget:
            return ""
        self.replays += 1
        sentence, findings = self.forensics.locate(lambda: loop.forward_backward(step.microbatches), step.first_sample)
        loop.drop_gradients()
        self.record = {"nonfinite/step": step.number} | findings
        return " " + sentence

    def _check_spike(self, loss: float, step: TakenStep) -> None:
        if self.spikes is None:
            return
        zscore = self.spikes.check(loss)
        if zscore is None:
            return
        self.loss_spikes += 1
        if self.is_logging_rank:
            logger.warning(
                "step %d: loss spike: %.4f is %.1f standard deviations above the mean of the last %d losses, on %s",
                step.number, loss, zscore, self.spike_window, self._samples(step),
            )
