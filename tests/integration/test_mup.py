"""µP and CompleteP end to end: the coordinate check through the trainer, Hugging Face exports of µP models, and a
resume under another layout keeping every multiplier and per-parameter learning rate."""

import shutil
from pathlib import Path

import pytest
import torch

from bench.coord_check import DEFAULTS, coordinates, fixed_batch
from tests.launch import TINY, train_and_read_params

pytestmark = pytest.mark.slow


def test_coordinate_check_holds_under_mup_and_fails_under_the_standard_logit_scaling(tmp_path):
    """Three AdamW steps on one fixed batch of 4 x 32 tokens, the tiny model at widths 64 (the base) and 256: under
    µP every coordinate's change (each block's output, the logits) stays within a factor 2 (measured 0.93 for the
    blocks, 0.76 for the logits, which converge from above as the initial output layer's share fades like
    1/sqrt(width)). With the standard parametrization's logit scaling (mup_logit_multiplier 4 x base / width = 1)
    the logits' change grows with the width: measured 2.7x at 4x the width (under SP altogether: docs/mup.md)."""
    data, tokens = fixed_batch(tmp_path, batch=4, seq_len=32)
    mup = [*DEFAULTS, *data, "--model.parametrization", "mup"]
    base = coordinates([*mup, "--model.dim", "64"], 3, tokens)
    wide = coordinates([*mup, "--model.dim", "256"], 3, tokens)
    ratios = {name: wide.change[name] / base.change[name] for name in base.change}
    assert all(1 / 2 <= ratio <= 2 for ratio in ratios.values()), ratios
    standard_logits = coordinates([*mup, "--model.dim", "256", "--model.mup_logit_multiplier", "4"], 3, tokens)
    assert standard_logits.change["logits"] / base.change["logits"] > 2


def _parametrization(folder: Path) -> tuple[dict, dict]:
    """Every parameter's optimizer group settings and every module's multipliers, merged over the ranks' dumps
    (tests/train_and_dump.py); a value two ranks both hold must agree."""
    groups, multipliers = {}, {}
    for path in sorted(folder.glob("parametrization_rank*.pt")):
        dump = torch.load(path)
        for merged, part in ((groups, dump["groups"]), (multipliers, dump["multipliers"])):
            for name, value in part.items():
                assert merged.setdefault(name, value) == value, name
    return groups, multipliers


def test_a_resume_under_another_layout_keeps_every_multiplier_and_learning_rate(tmp_path):
    """CompleteP at twice the base width and depth, trained 4 steps at dp2 ZeRO-1 and saved at step 2, then resumed at
    step 2 under pp2 (1F1B): every parameter's learning rate, weight decay and eps and every module's multipliers equal
    the uninterrupted run's bitwise, and so do its losses within 1e-5 (measured: fp32 reduction order)."""
    args = [*TINY, "--model.dim", "128", "--model.n_layers", "4", "--model.parametrization", "complete_p",
            "--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "2"]  # fmt: skip
    uninterrupted, _ = train_and_read_params([*args, "--training.local_batch_size", "2", "--optimizer.zero_stage", "1"],
                                             2, tmp_path / "dp2")  # fmt: skip
    shutil.copytree(tmp_path / "dp2" / "checkpoint" / "step-2", tmp_path / "pp2" / "checkpoint" / "step-2")
    pp2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B"]
    resumed, _ = train_and_read_params([*args, *pp2, "--checkpoint.load_step", "2"], 2, tmp_path / "pp2")
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in uninterrupted[2:]], abs=1e-5)
    groups, multipliers = _parametrization(tmp_path / "dp2")
    assert len(groups) == 3 + 9 * 4 and multipliers["logits"] == 0.5  # embedding, norm, output; 9 per block
    assert (groups, multipliers) == _parametrization(tmp_path / "pp2")
