"""The step guard on its own, with a toy model, optimizer and loop (no Trainer): a non-finite step is never applied,
whether its verdict is read at once or during the next step; a replay names where the NaN started; a stop saves the
state before the failed step; a spike is warned about; and its counters are what a resumed run continues."""

import functools
import logging
import math

import pytest
import torch
from torch import nn

from tests.optimizers import plain_optimizer
from torchpre.config.job_config import Training
from torchpre.health.forensics import Forensics
from torchpre.health.guard import StepGuard, TakenStep
from torchpre.health.verdict import NonFiniteError
from torchpre.step_rules.batch import BatchSizes, CurrentBatch

ROWS = 3


class ToyLoop:
    """What the guard asks of the training loop, over a two-layer model: the loss share is the model's output sum
    (NaN for a batch that holds one), and every call is recorded."""

    def __init__(self, world, fused: bool) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        self.optimizer = plain_optimizer(
            list(self.model.named_parameters()), zero_stage=0, dp_group=world, tp_group=world, pp_group=world,
            weight_decay=0.0, max_norm=1.0,
            build_inner=functools.partial(torch.optim.AdamW, lr=1e-2, fused=fused),
        )  # fmt: skip
        self.calls: list[str] = []
        self.step, self.first_sample = 0, 0

    def forward_backward(self, microbatches) -> torch.Tensor:
        self.calls.append("forward_backward")
        loss = sum(self.model(inputs).sum() for inputs, _ in microbatches)
        loss.backward()
        return loss.detach()

    def drop_gradients(self) -> None:
        self.calls.append("drop_gradients")
        self.optimizer.reduction.reduce()
        self.optimizer.discard()

    def rewind(self, step: TakenStep) -> None:
        self.calls.append(f"rewind {step.number}")
        self.step, self.first_sample = step.number - 1, step.first_sample

    def save_last_good_state(self) -> str:
        self.calls.append(f"save {self.step}")
        return f"Saved step {self.step}."

    def take(self, guard: StepGuard, inputs: torch.Tensor, read_now: bool = True):
        """One step of a training loop over `guard`: forward/backward, the previous verdict, reduction, verdict."""
        batches = [(inputs, None)]
        loss = self.forward_backward(batches)
        loss = guard.settle_previous(loss, batches, self)
        grad_norm = self.optimizer.reduce_gradients()
        taken = TakenStep(self.step + 1, self.first_sample, batches, grad_norm, {})
        health = guard.apply(loss, taken, self, stop_requested=False, read_now=read_now)
        self.step, self.first_sample = self.step + 1, self.first_sample + ROWS
        return health

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def _guard(loop: ToyLoop, **settings) -> StepGuard:
    forensics = Forensics([loop.model], [0], dp_rank=0, dp_size=1, local_batch_size=ROWS, rows_per_microbatch=ROWS)
    batch = CurrentBatch(BatchSizes(ROWS, 1, ROWS, 4))
    return StepGuard(Training(**settings), loop.optimizer, forensics, tp_degree=1, batch=batch, is_logging_rank=True)


def _inputs(seed: int, poisoned: bool = False) -> torch.Tensor:
    inputs = torch.randn(ROWS, 4, generator=torch.Generator().manual_seed(seed))
    if poisoned:
        inputs[1, 2] = math.nan
    return inputs


@pytest.mark.parametrize("read_now", [True, False], ids=["read-at-once", "read-during-the-next-step"])
def test_a_skipped_step_leaves_the_model_as_it_was_and_the_next_step_trains(world, read_now):
    loop = ToyLoop(world, fused=True)
    guard = _guard(loop, on_nonfinite="skip", nonfinite_forensics=0)
    loop.take(guard, _inputs(0))
    before = loop.params()
    health = loop.take(guard, _inputs(1, poisoned=True), read_now=read_now)
    assert (health is None) == (not read_now)  # a deferred verdict is not read yet...
    assert all(map(torch.equal, before, loop.params()))  # ...but the update was skipped on the device already
    assert guard.skipped_steps == (1 if read_now else 0)
    health = loop.take(guard, _inputs(2))  # reads the poisoned step's verdict first, if deferred
    assert health.finite and guard.skipped_steps == 1 and not math.isnan(guard.last_loss)
    assert not all(map(torch.equal, before, loop.params()))
    assert "drop_gradients" not in loop.calls  # a skip keeps the next step's gradients: no replay asked for them


def test_the_read_late_skip_gives_the_same_model_as_the_read_at_once_skip(world):
    """Deferring the verdict is bitwise free: the step after a skip trains on the state the skip left."""
    results = []
    for read_now in (True, False):
        loop = ToyLoop(world, fused=True)
        guard = _guard(loop, on_nonfinite="skip", nonfinite_forensics=0)
        for seed, poisoned in ((0, False), (1, True), (2, False), (3, False)):
            loop.take(guard, _inputs(seed, poisoned), read_now=read_now)
        loop.take(guard, _inputs(4))  # reads the last deferred verdict
        results.append(loop.params())
    assert all(map(torch.equal, *results))


def test_forensics_replay_the_step_and_name_the_first_module(world, caplog):
    loop = ToyLoop(world, fused=False)
    guard = _guard(loop, on_nonfinite="skip", nonfinite_forensics=1)
    loop.take(guard, _inputs(0))
    loop.calls.clear()
    with caplog.at_level(logging.WARNING, logger="torchpre"):
        loop.take(guard, _inputs(1, poisoned=True))
    assert loop.calls == ["forward_backward", "forward_backward", "drop_gradients"]  # the step, its replay
    assert guard.has_findings
    record = guard.metrics()
    assert record["nonfinite/step"] == 2 and record["nonfinite/first_module"] == "0"
    assert record["nonfinite/phase"] == "forward" and record["skipped_steps"] == 1
    assert not guard.has_findings  # a record carries the findings once
    assert "on global samples [3, 6)" in caplog.text and "output of 0 (forward) on rank 0" in caplog.text
    loop.calls.clear()
    loop.take(guard, _inputs(2, poisoned=True))  # the budget of one replay is spent
    assert loop.calls == ["forward_backward"] and guard.skipped_steps == 2


def test_a_stop_read_late_rewinds_to_before_the_failed_step_and_saves_it(world):
    loop = ToyLoop(world, fused=True)
    guard = _guard(loop, on_nonfinite="stop", nonfinite_forensics=0)
    loop.take(guard, _inputs(0), read_now=False)
    loop.take(guard, _inputs(1, poisoned=True), read_now=False)
    with pytest.raises(NonFiniteError, match=r"step 2: the loss and the gradient norm is not finite .* Saved step 1\."):
        loop.take(guard, _inputs(2), read_now=False)
    assert loop.calls[-3:] == ["drop_gradients", "rewind 2", "save 1"]
    assert (loop.step, loop.first_sample) == (1, ROWS)


def test_a_spike_is_warned_about_and_counted(world, caplog):
    loop = ToyLoop(world, fused=False)
    guard = _guard(loop, spike_zscore=3.0, spike_window=4)
    step = TakenStep(5, 12, [], torch.tensor(1.0), {})
    for loss in (2.0, 2.1, 1.9, 2.0):
        guard._check_spike(loss, step)
    with caplog.at_level(logging.WARNING, logger="torchpre"):
        guard._check_spike(9.0, step)
    assert guard.loss_spikes == 1
    assert "step 5: loss spike: 9.0000 is" in caplog.text and "global samples [12, 15)" in caplog.text


def test_the_counters_are_checkpointed_and_an_older_checkpoint_leaves_them_at_zero(world):
    loop = ToyLoop(world, fused=False)
    guard = _guard(loop)
    guard.skipped_steps, guard.loss_spikes, guard.replays = 3, 2, 1
    state = guard.state_dict()
    assert state == {"skipped_steps": 3, "loss_spikes": 2, "nonfinite_replays": 1}
    resumed = _guard(loop)
    assert resumed.load_targets({"model.weight"}) == {}  # a checkpoint written before the guard saved them
    resumed.load_state_dict(state)
    assert (resumed.skipped_steps, resumed.loss_spikes, resumed.replays) == (3, 2, 1)
