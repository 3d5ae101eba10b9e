"""A weighted mixture of datasets as a sample order: which source, and which of its samples, sits at
each global position, computable for any position without replaying the ones before it."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from torchpre.data.sampler import EpochShuffle

# Positions are dealt out to sources in blocks of about this many: every source's count is within one
# sample of its weight's share at each block end, and the order inside a block is a seeded shuffle.
BLOCK_SIZE = 1024
# Keeps the seeds of the sources' orders and of the blocks' shuffles apart, though both derive from training.seed.
_SOURCE_STREAM, _BLOCK_STREAM = 0, 1


@dataclasses.dataclass(frozen=True)
class Source:
    name: str
    num_samples: int
    weight: float


class MixtureOrder:
    """Maps global position p to an index into the concatenation of the sources' samples.

    Block b covers positions [start(b), start(b+1)) with start(b) = sum over sources of
    floor(b * BLOCK_SIZE * w_s) and w normalised: so source s gets exactly floor(b * BLOCK_SIZE * w_s)
    of the positions before block b, the long-run share is exactly w_s, and a tiny weight still gets
    its samples (one every few blocks). A block's positions are the sources' counts shuffled by
    (seed, b). Source s's k-th position takes sample EpochShuffle(k) of its own seeded order, so each
    source runs through its own epochs independently of the others.

    Everything is a function of (seed, sources, p): the order is the same for any layout and a resume
    needs only the number of positions consumed.
    """

    def __init__(self, sources: list[Source], seed: int):
        total = sum(source.weight for source in sources)
        self.sources = sources
        self.rates = [BLOCK_SIZE * source.weight / total for source in sources]
        self.offsets = [0, *np.cumsum([source.num_samples for source in sources]).tolist()]
        # numpy seeds must be non-negative: a negative training.seed maps to a distinct non-negative one.
        self._entropy = seed % 2**64
        self.shuffles = [EpochShuffle(source.num_samples, self._source_seed(i)) for i, source in enumerate(sources)]
        self._block = -1
        self._slots = np.empty(0, dtype=np.int64)

    def __call__(self, position: int) -> int:
        block, offset = self._locate(position)
        slots = self._block_slots(block)
        source = int(slots[offset])
        k = self._before(source, block) + int(np.count_nonzero(slots[:offset] == source))
        return self.offsets[source] + self.shuffles[source](k)

    def source_counts(self, end: int) -> list[int]:
        """How many of the positions [0, end) each source fills."""
        block, offset = self._locate(end)
        slots = self._block_slots(block)[:offset]
        return [self._before(s, block) + int(np.count_nonzero(slots == s)) for s in range(len(self.sources))]

    def _source_seed(self, source: int) -> int:
        return int(np.random.SeedSequence([self._entropy, _SOURCE_STREAM, source]).generate_state(1)[0])

    def _before(self, source: int, block: int) -> int:
        """Positions of `source` in the blocks before `block`."""
        return math.floor(block * self.rates[source])

    def _start(self, block: int) -> int:
        return sum(self._before(s, block) for s in range(len(self.sources)))

    def _locate(self, position: int) -> tuple[int, int]:
        """(block, offset in the block) of a position; blocks hold BLOCK_SIZE +- (sources - 1) positions."""
        block = position // BLOCK_SIZE
        while self._start(block) > position:
            block -= 1
        while self._start(block + 1) <= position:
            block += 1
        return block, position - self._start(block)

    def _block_slots(self, block: int) -> np.ndarray:
        """The source of each position in the block, shuffled by (seed, block); the last block is cached."""
        if block != self._block:
            counts = [self._before(s, block + 1) - self._before(s, block) for s in range(len(self.sources))]
            slots = np.repeat(np.arange(len(self.sources)), counts)
            self._slots = np.random.default_rng([self._entropy, _BLOCK_STREAM, block]).permutation(slots)
            self._block = block
        return self._slots
