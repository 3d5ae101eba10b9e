"""`python -m bench.vs_transformers --quick`: both loops really train, and the tables report their numbers.

The two loops start from different initial weights (torchpre's init rule vs transformers'), so their
first losses differ; each must still be finite and near ln(vocab), the loss of a model that has not
learned anything yet, which a loop fed no tokens, wrong labels or a broken model would not give.
"""

import math

import pytest

from bench.vs_transformers import main

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

VOCAB_SIZE = 2048  # the shipped tokenizer
FIRST_LOSS_TOLERANCE = 1.0  # torchpre's init gives logits of std ~1 (about +0.5); transformers' near-zero logits


def test_quick_run_reports_real_throughput_mfu_and_losses(capsys):
    report = main(["--quick"])
    out = capsys.readouterr().out

    [comparison] = report.comparisons
    assert (comparison.setup.name, comparison.mode) == ("tiny", "eager")
    hf, torchpre = comparison.transformers, comparison.torchpre
    assert hf.tokens_per_sec > 0 and torchpre.tokens_per_sec > 0
    assert comparison.ratio == pytest.approx(torchpre.tokens_per_sec / hf.tokens_per_sec)
    for result in (hf, torchpre):
        assert 0 < comparison.mfu(result, report.peak_flops) < 2
        assert math.isfinite(result.first_loss)
        assert abs(result.first_loss - math.log(VOCAB_SIZE)) < FIRST_LOSS_TOLERANCE, result.first_loss

    throughput = f"{hf.tokens_per_sec:,.0f} | {torchpre.tokens_per_sec:,.0f} | {comparison.ratio:.2f}x"
    assert f"| tiny | eager | {throughput} |" in out
    assert f"{comparison.mfu(torchpre, report.peak_flops):.1%}" in out
