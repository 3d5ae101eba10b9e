"""The head-tail split of context parallelism: torch's load balancer's positions, and equal causal work per rank."""

import pytest
import torch
from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

from torchpre.parallel.context_parallel import head_tail_positions


@pytest.mark.parametrize("seq_len, cp", [(16, 2), (32, 4), (24, 3), (8, 1)])
def test_head_tail_positions_are_torchs_and_cover_the_sequence(seq_len, cp):
    """Rank i holds chunks i and 2cp-1-i: the rows of torch's head-tail reordering that land on rank i."""
    reordered = _HeadTailLoadBalancer(seq_len, cp, "cpu")._generate_indices()[0].long()
    shards = [head_tail_positions(seq_len, cp, rank) for rank in range(cp)]
    torch.testing.assert_close(torch.cat(shards), reordered, rtol=0, atol=0)
    assert sorted(torch.cat(shards).tolist()) == list(range(seq_len))


def test_every_rank_does_the_same_causal_work():
    """Keys each rank's queries see under the causal mask (position p sees p + 1): equal across ranks; a
    contiguous split would give the last rank 7x the first's at cp4."""
    seq_len, cp = 64, 4
    work = [int((head_tail_positions(seq_len, cp, rank) + 1).sum()) for rank in range(cp)]
    assert len(set(work)) == 1
