"""Warmup-stable-decay values at the phase boundaries."""

import math

import pytest
import torch

from torchpre.optim.lr_scheduler import build_lr_scheduler, wsd_factor


def factors(steps=20, warmup=4, ratio=0.5, kind="linear", floor=0.0):
    return [
        wsd_factor(s, steps=steps, warmup_steps=warmup, decay_ratio=ratio, decay_type=kind, min_lr_factor=floor)
        for s in range(steps)
    ]


def test_warmup_is_linear_and_never_zero():
    assert factors()[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])


def test_stable_phase_then_linear_decay_to_the_floor():
    f = factors(steps=20, warmup=4, ratio=0.5, floor=0.1)
    # 16 post-warmup steps, the last 8 decay: steps 12..19
    assert f[4:12] == [1.0] * 8
    assert f[12] == pytest.approx(0.1 + 0.9 * (1 - 1 / 8))
    assert f[19] == pytest.approx(0.1)


@pytest.mark.parametrize(
    "kind, expected", [("sqrt", 1 - math.sqrt(0.5)), ("cosine", 0.5 * (1 + math.cos(math.pi * 0.5)))]
)
def test_decay_shapes_at_half_way(kind, expected):
    f = factors(steps=10, warmup=0, ratio=1.0, kind=kind)
    assert f[4] == pytest.approx(expected)


def test_no_decay_with_ratio_zero():
    assert factors(steps=10, warmup=2, ratio=0.0)[2:] == [1.0] * 8


def test_scheduler_drives_the_optimizer_lr():
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_lr_scheduler(
        optimizer, steps=6, warmup_steps=2, decay_ratio=1.0, decay_type="linear", min_lr_factor=0.0
    )
    seen = []
    for _ in range(6):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([1 / 3, 2 / 3, 0.75, 0.5, 0.25, 0.0])


def test_the_schedule_holds_the_floor_past_its_last_step():
    """The scheduler steps once after the last optimizer step; that lr (saved in the last checkpoint) is the floor,
    never below it."""
    assert wsd_factor(6, steps=6, warmup_steps=2, decay_ratio=1.0, decay_type="linear", min_lr_factor=0.1) == 0.1


def test_a_resume_with_more_steps_continues_on_the_new_schedule():
    """A job of 4 steps saved after its last step, resumed with training.steps = 8: step 5 uses the 8-step schedule's
    lr at step index 4, not what the 4-step schedule left (it was -0.5x the peak before the floor was held)."""
    settings = {"warmup_steps": 2, "decay_ratio": 1.0, "decay_type": "linear", "min_lr_factor": 0.0}
    first = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_lr_scheduler(first, steps=4, **settings)
    for _ in range(4):
        first.step()
        scheduler.step()
    resumed = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    build_lr_scheduler(resumed, steps=8, **settings).load_state_dict(scheduler.state_dict())
    assert resumed.param_groups[0]["lr"] == pytest.approx(wsd_factor(4, steps=8, **settings)) == pytest.approx(0.5)
