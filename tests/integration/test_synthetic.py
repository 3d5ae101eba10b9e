"""`training.dataset = "synthetic"` end to end: the same losses on dp1 and dp2, a resume under another layout
that continues the same batches, and Llama 3's 128,256-token vocabulary without a tokenizer file."""

import math
import shutil

import pytest

from tests.launch import TINY, train_and_read_metrics

pytestmark = pytest.mark.slow

SYNTHETIC = [*TINY, "--training.dataset", "synthetic", "--model.vocab_size", "3000", "--training.steps", "4"]
HALF = ["--training.local_batch_size", "2"]  # dp2 x 2: the global batch of 4 that dp1 trains in one microbatch
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "2"]
# fp32 on CPU: dp1 and dp2 differ only in the order of the gradient and loss reductions (~1e-7 per step over
# 4 steps); a wrong slice of the global batch changes the loss of random tokens by > 1e-3.
LAYOUT_ATOL = 1e-5


def test_synthetic_losses_are_layout_invariant_and_a_resume_continues_the_batches(tmp_path):
    dp1 = train_and_read_metrics([*SYNTHETIC, *CKPT], 1, tmp_path)
    assert [r["step"] for r in dp1] == [1, 2, 3, 4]
    # No model predicts uniform random tokens better than a uniform guess, ln(vocab_size) (0.1: the noise of the
    # mean over one batch's 128 tokens).
    assert dp1[0]["loss"] > math.log(3000) - 0.1
    dp2 = train_and_read_metrics([*SYNTHETIC, *HALF], 2, tmp_path / "dp2")
    assert [r["loss"] for r in dp2] == pytest.approx([r["loss"] for r in dp1], abs=LAYOUT_ATOL)

    shutil.rmtree(tmp_path / "checkpoint" / "step-4")
    (tmp_path / "metrics.jsonl").unlink()
    resumed = train_and_read_metrics([*SYNTHETIC, *CKPT, *HALF], 2, tmp_path)  # from step 2, under dp2
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in dp1[2:]], abs=LAYOUT_ATOL)


def test_the_llama3_vocabulary_trains_without_a_tokenizer_file(tmp_path):
    args = [*TINY, "--training.dataset", "synthetic", "--model.vocab_size", "128256", "--training.steps", "2"]
    records = train_and_read_metrics([*args, "--training.local_batch_size", "2"], 1, tmp_path)
    assert records[0]["loss"] > math.log(128_256) - 0.1  # 11.76, as in the test above
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in records)
