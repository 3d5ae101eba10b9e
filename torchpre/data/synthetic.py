"""Random tokens for benchmarks: any vocabulary (Llama 3's 128,256) without a tokenizer file or a corpus."""

import numpy as np
import torch
from torch.utils.data import Dataset

# Samples the synthetic source offers: more than any run consumes, so the order never wraps into a second epoch.
NUM_SYNTHETIC_SAMPLES = 2**62


class SyntheticTokens(Dataset):
    """Sample i is seq_len + 1 tokens drawn uniformly from [0, vocab_size) by a generator seeded with
    (seed, i), split into input and labels.

    Each sample depends on its global index alone, like a window of a real corpus, so the batches are the
    same for every data-parallel layout and a resumed run continues them exactly.
    """

    def __init__(self, seq_len: int, vocab_size: int, seed: int):
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.seed = seed

    def __len__(self) -> int:
        return NUM_SYNTHETIC_SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        # SeedSequence mixes (seed, index) into independent streams; it takes non-negative entropy only.
        rng = np.random.default_rng([self.seed % 2**64, index])
        window = torch.from_numpy(rng.integers(0, self.vocab_size, self.seq_len + 1, dtype=np.int64))
        return window[:-1], window[1:]


def in_order(position: int) -> int:
    """The synthetic source's order: position p is sample p (the samples are random already)."""
    return position
