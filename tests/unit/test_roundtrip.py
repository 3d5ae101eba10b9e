"""The state round-trip comparison on hand-made states: what it reports equal, different and missing."""

import torch

from torchpre.checkpoint.roundtrip import canonical, compare_states


def _state(weight: torch.Tensor, master: torch.Tensor | None = None, world_size: int = 2) -> dict:
    """A canonical checkpoint state of one parameter `w`; `master` for a low-precision run."""
    state = {
        "model.w": weight,
        "optimizer.w.exp_avg": torch.full((2, 3), 0.5),
        "optimizer.w.exp_avg_sq": torch.full((2, 3), 0.25),
        "optimizer.w.step": torch.tensor(5.0),
        "lr_scheduler.last_epoch": 5,
        "train.step": 5,
        "train.consumed_samples": 40,
        "train.world_size": world_size,
        "rng.rank0": torch.arange(4, dtype=torch.uint8),
    }
    if master is not None:
        state["optimizer.w.master"] = master
    return canonical(state)


FP32 = torch.linspace(-1, 1, 6).reshape(2, 3) + 1e-3  # not representable in bf16


def test_identical_states_are_equal_and_layout_keys_are_left_out():
    saved, live = _state(FP32), _state(FP32.clone(), world_size=4)
    live["rng.rank1"] = torch.zeros(4, dtype=torch.uint8)  # a rank the saving job did not have
    report = compare_states(saved, live)
    assert report.ok, str(report)
    assert report.compared == len(saved)
    assert "optimizer.w.master" in saved  # an fp32 parameter is its own master


def test_one_differing_element_and_a_missing_key_are_named():
    saved, live = _state(FP32), _state(FP32.clone())
    live["optimizer.w.exp_avg"][1, 2] += 1e-7
    del live["optimizer.w.step"]
    live["lr_scheduler.last_epoch"] = 4
    report = compare_states(saved, live)
    assert not report.ok
    assert report.missing == ["optimizer.w.step"]
    assert report.different[0].startswith("lr_scheduler.last_epoch: 5 vs 4")
    assert report.different[1].startswith("optimizer.w.exp_avg: 1 of 6 elements differ")
    assert "optimizer.w.step" in str(report)


def test_a_dtype_change_compares_masters_in_full_and_parameters_rounded():
    """bf16 saved (master kept), fp32 loaded: equal only if the fp32 parameter is the saved master."""
    saved = _state(FP32.bfloat16(), master=FP32)
    assert compare_states(saved, _state(FP32.clone())).ok
    rounded = compare_states(saved, _state(FP32.bfloat16().float()))
    assert [line.split(":")[0] for line in rounded.different] == ["optimizer.w.master"]
