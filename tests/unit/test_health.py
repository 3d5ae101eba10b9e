"""The training-health pieces on their own: loss-spike detection, the non-finite verdict, discarding a
step in the optimizer, and the CPU phase timer."""

import functools
import math
import time

import pytest
import torch
from torch import nn

from tests.optimizers import plain_optimizer
from torchpre.health.spikes import LossSpikeDetector
from torchpre.health.verdict import step_verdict
from torchpre.metrics.timer import PhaseTimer
from torchpre.optim.distributed_optimizer import DistributedOptimizer


def test_spike_detector_flags_only_losses_far_above_a_full_window():
    detector = LossSpikeDetector(zscore=6.0, window=8)
    noisy = [3.0 + 0.01 * (-1) ** i for i in range(8)]  # mean 3.0, standard deviation 0.01
    assert [detector.check(loss) for loss in [10.0, 0.0, *noisy[2:]]] == [None] * 8  # silent until the window is full
    detector = LossSpikeDetector(zscore=6.0, window=8)
    for loss in noisy:
        assert detector.check(loss) is None
    assert detector.check(3.05) is None  # 5 standard deviations: below the threshold
    detector = LossSpikeDetector(zscore=6.0, window=8)
    for loss in noisy:
        detector.check(loss)
    assert detector.check(3.07) == pytest.approx(7.0)
    assert detector.check(2.0) is None  # a drop is never a spike


def test_spike_detector_ignores_a_flat_window_and_non_finite_losses():
    detector = LossSpikeDetector(zscore=3.0, window=4)
    for loss in [2.0, 2.0, 2.0, 2.0]:
        detector.check(loss)
    assert detector.check(5.0) is None  # zero deviation: no z-score to speak of
    detector = LossSpikeDetector(zscore=3.0, window=3)
    for loss in [1.0, math.nan, 1.1, math.inf, 0.9]:
        detector.check(loss)
    assert detector.check(100.0) is not None  # the window holds 1.0, 1.1, 0.9 only


def test_step_verdict_names_what_is_not_finite_and_flags_the_skip_on_the_device(world):
    finite = step_verdict(torch.tensor(2.0), torch.tensor(1.0), tp_degree=1)
    assert finite.read().finite and finite.read().loss == 2.0 and finite.skip.item() == 0.0
    bad_norm = step_verdict(torch.tensor(2.0), torch.tensor(math.nan), tp_degree=1)
    assert not bad_norm.read().finite and bad_norm.read().describe_nonfinite() == "the gradient norm"
    assert bad_norm.skip.item() == 1.0 and bad_norm.skip.dtype == torch.float32
    both = step_verdict(torch.tensor(math.inf), torch.tensor(math.inf), tp_degree=1, stop_requested=True)
    assert both.read().describe_nonfinite() == "the loss and the gradient norm" and both.read().stop_requested
    assert both.skip.item() == 1.0


def test_discarded_step_leaves_parameters_and_optimizer_state_bitwise_unchanged(world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    optimizer = plain_optimizer(
        list(model.named_parameters()), zero_stage=0, state_mesh=None, dp_group=world, tp_group=world,
        pp_group=world, accumulate_in_fp32=True, weight_decay=0.1, max_norm=1.0,
        build_inner=functools.partial(torch.optim.AdamW, lr=1e-2, betas=(0.9, 0.95), eps=1e-8),
    )
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    params = [p.detach().clone() for p in model.parameters()]
    state = [v.clone() for s in optimizer.inner.state.values() for v in s.values()]

    (model(torch.randn(3, 4)).sum() * math.nan).backward()
    assert optimizer.reduce_gradients().isnan()
    optimizer.discard()
    for before, after in zip(params, model.parameters()):
        assert torch.equal(before, after)
    assert all(map(torch.equal, state, [v for s in optimizer.inner.state.values() for v in s.values()]))

    model(torch.randn(3, 4)).sum().backward()  # the NaN gradients are gone: the next step is finite
    assert optimizer.reduce_gradients().isfinite()
    optimizer.apply()
    assert not torch.equal(params[0], model[0].weight)


def _two_layers_and_optimizer(world, **implementation) -> tuple[nn.Module, DistributedOptimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    optimizer = plain_optimizer(
        list(model.named_parameters()), zero_stage=0, state_mesh=None, dp_group=world, tp_group=world,
        pp_group=world, accumulate_in_fp32=True, weight_decay=0.1, max_norm=1.0,
        build_inner=functools.partial(torch.optim.AdamW, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, **implementation),
    )
    return model, optimizer


def _snapshot(model: nn.Module, optimizer: DistributedOptimizer) -> list[torch.Tensor]:
    """Parameters and every optimizer state tensor (step counts included)."""
    state = [value for values in optimizer.inner.state.values() for value in values.values()]
    return [t.detach().clone() for t in [*model.parameters(), *state]]


def test_a_step_skipped_on_the_device_is_bitwise_a_discarded_one_and_a_kept_one_is_applied(world):
    """The fused optimizer's conditional step (the verdict never leaves the device): a skip flag of 1 leaves
    parameters and state (step counts too) bitwise unchanged, and of 0 gives bitwise the unconditional step."""
    model, optimizer = _two_layers_and_optimizer(world, fused=True)
    assert optimizer.applies_conditionally
    inputs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    model(inputs[0]).sum().backward()
    optimizer.step()
    before = _snapshot(model, optimizer)
    (model(inputs[1]).sum() * math.nan).backward()
    verdict = step_verdict(torch.tensor(1.0), optimizer.reduce_gradients(), tp_degree=1)
    optimizer.apply(skip=verdict.skip)
    assert all(map(torch.equal, before, _snapshot(model, optimizer)))

    reference, unconditional = _two_layers_and_optimizer(world, fused=True)
    for net, opt, skip in ((model, optimizer, torch.tensor(0.0)), (reference, unconditional, None)):
        if skip is None:  # the reference catches up on the first step
            net(inputs[0]).sum().backward()
            opt.step()
        net(inputs[2]).sum().backward()
        opt.reduce_gradients()
        opt.apply(skip=skip)
    assert all(map(torch.equal, _snapshot(reference, unconditional), _snapshot(model, optimizer)))

    _, foreach = _two_layers_and_optimizer(world)
    assert not foreach.applies_conditionally
    with pytest.raises(ValueError, match="cannot skip a step on the device"):
        foreach.apply(skip=torch.tensor(1.0))


def test_phase_timer_averages_nested_phases_per_step_and_starts_over():
    timer = PhaseTimer(torch.device("cpu"))
    for _ in range(2):
        with timer.phase("optimizer"):
            with timer.phase("grad_comm"):
                time.sleep(0.01)
    averages = timer.averages(steps=2)
    assert 0.01 <= averages["grad_comm"] <= averages["optimizer"] < 0.1
    assert timer.averages(steps=1) == {}
