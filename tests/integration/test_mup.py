"""µP and CompleteP end to end: the coordinate check through the trainer, Hugging Face exports of µP models, and a
resume under another layout keeping every multiplier and per-parameter learning rate."""

import pytest

from bench.coord_check import DEFAULTS, coordinates, fixed_batch

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
