"""The order of samples: a function of the seed over global sample positions, not of the layout.

Two orders have been used; a run's data state records which (`order_version`), so that a checkpoint resumes with
the order it was trained on: version 1, `EpochShuffle` (a torch.randperm per epoch: 8 bytes per sample on every
rank, 15 GB at 1.8 billion windows), in every checkpoint saved before the version was recorded; version 2,
`FeistelShuffle` (a keyed bijection computed per position: memory independent of the number of samples), for new
runs.
"""

from collections.abc import Callable, Iterator

import numpy as np
import torch

# Maps a global sample position (0, 1, 2, ... over the whole run) to the index of the sample there.
SampleOrder = Callable[[int], int]


class EpochShuffle:
    """Position p is sample permutation_e[p mod n] of epoch e = p // n: every sample once per epoch, in
    an order drawn anew each epoch from `seed + e` (order version 1).

    Only the current epoch's permutation is kept (8 bytes per sample), so any position is computable
    without replaying the positions before it.
    """

    def __init__(self, num_samples: int, seed: int):
        self.num_samples = num_samples
        self.seed = seed
        self._epoch = -1
        self._permutation = torch.empty(0, dtype=torch.int64)

    def __call__(self, position: int) -> int:
        epoch, offset = divmod(position, self.num_samples)
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._permutation = torch.randperm(self.num_samples, generator=generator)
            self._epoch = epoch
        return int(self._permutation[offset])


_MASK = 2**64 - 1
_ROUNDS = 6  # each half rewritten three times, from the other half: ample mixing for a data order
_ORDER_STREAM = 2  # keeps the epochs' keys apart from the mixture's streams (mixture.py); all derive from the seed


class FeistelShuffle:
    """Position p is sample pi_e(p mod n) of epoch e = p // n (order version 2): every sample once per epoch, in an
    order drawn anew each epoch from (seed, e), in memory that does not grow with n.

    pi_e is a Feistel network on the bits of [0, 2^k), 2^k the power of two at or above n, keyed by (seed, e): the
    index is split into its high and low halves and each round replaces one half by itself xor a keyed hash
    (splitmix64's finalizer) of the other, alternately, which is a bijection whatever the keys. An index it maps
    beyond n is mapped again (cycle walking) until it lands in [0, n), which restricts the bijection to [0, n):
    fewer than 2 rounds of walking on average, since 2^k < 2n.
    """

    def __init__(self, num_samples: int, seed: int):
        self.num_samples = num_samples
        self.seed = seed
        bits = max(2, (num_samples - 1).bit_length())
        self._low_bits = bits // 2
        self._low_mask, self._high_mask = (1 << self._low_bits) - 1, (1 << (bits - self._low_bits)) - 1
        self._epoch = -1
        self._keys: list[int] = []

    def __call__(self, position: int) -> int:
        epoch, offset = divmod(position, self.num_samples)
        if epoch != self._epoch:
            entropy = [self.seed % 2**64, _ORDER_STREAM, epoch]  # SeedSequence takes non-negative words
            self._keys = np.random.SeedSequence(entropy).generate_state(_ROUNDS, np.uint64).tolist()
            self._epoch = epoch
        index = self._permute(offset)
        while index >= self.num_samples:
            index = self._permute(index)
        return index

    def _permute(self, index: int) -> int:
        high, low = index >> self._low_bits, index & self._low_mask
        for round_number, key in enumerate(self._keys):
            if round_number % 2:
                low ^= _hash(high, key) & self._low_mask
            else:
                high ^= _hash(low, key) & self._high_mask
        return (high << self._low_bits) | low


def _hash(value: int, key: int) -> int:
    """64 well-mixed bits of (value, key): splitmix64's finalizer of value's golden-ratio multiple plus key."""
    x = (value * 0x9E3779B97F4A7C15 + key) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


# The sample orders by version; new runs use ORDER_VERSION, a resume the version its checkpoint records.
ORDERS: dict[int, Callable[[int, int], SampleOrder]] = {1: EpochShuffle, 2: FeistelShuffle}
ORDER_VERSION = 2


def shuffle(num_samples: int, seed: int, version: int = ORDER_VERSION) -> SampleOrder:
    """The seeded order of `num_samples` samples, epoch after epoch, of order `version`."""
    return ORDERS[version](num_samples, seed)


class GlobalBatchSampler:
    """Yields this data-parallel rank's microbatches of sample indices, forever.

    `order` says which sample sits at each global position. Positions are consumed in rounds of
    `local_batch_size * dp_size`; in each round DP rank r takes the r-th contiguous slice. So the
    samples of an optimizer step, and their order, are the same for every DP degree and every split
    into accumulation microbatches with the same global batch.

    The state is the number of global positions consumed, which stays valid when the job resumes
    under another DP degree or local batch size.
    """

    def __init__(self, order: SampleOrder, local_batch_size: int, dp_rank: int, dp_size: int):
        self.order = order
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.consumed_samples = 0

    def __iter__(self) -> Iterator[list[int]]:
        return self

    def __next__(self) -> list[int]:
        start = self.consumed_samples + self.dp_rank * self.local_batch_size
        indices = [self.order(position) for position in range(start, start + self.local_batch_size)]
        self.consumed_samples += self.local_batch_size * self.dp_size
        return indices

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        consumed = state["consumed_samples"]
        round_size = self.local_batch_size * self.dp_size
        if consumed % round_size:
            raise ValueError(
                f"Cannot resume the data order at global sample {consumed}: it is not a multiple of "
                f"local_batch_size x dp ({round_size}). Resume at an optimizer-step boundary."
            )
        self.consumed_samples = consumed
