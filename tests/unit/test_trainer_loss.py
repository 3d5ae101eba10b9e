"""The training loss of any layout is the global-batch mean over tokens: each microbatch on each DP rank
contributes its summed token losses divided by the global token count, so the contributions add up to it."""

import torch
import torch.nn.functional as F

from torchpre.step_rules.batch import BatchSizes, CurrentBatch
from torchpre.training.loss import GlobalMeanLoss

DP, ACCUMULATION, SEQ_LEN, VOCAB = 2, 2, 8, 16


def test_microbatch_shares_sum_to_the_global_mean():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(DP * ACCUMULATION, SEQ_LEN, VOCAB, generator=generator)
    labels = torch.randint(0, VOCAB, (DP * ACCUMULATION, SEQ_LEN), generator=generator)
    loss = GlobalMeanLoss(CurrentBatch(BatchSizes(DP * ACCUMULATION, ACCUMULATION, 1, SEQ_LEN)))
    shares = [loss(x[None], y[None]) for x, y in zip(logits, labels)]  # one sequence each
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    # fp32 sums of 32 terms in another order: measured 0 difference here; 1e-6 relative is a few float32 ulps.
    torch.testing.assert_close(sum(shares), expected, rtol=1e-6, atol=0)
