"""A weighted mixture of datasets as a sample order: which source, and which of its samples, sits at
each global position, computable for any position without replaying the ones before it."""

from __future__ import annotations

import dataclasses

import numpy as np

from torchpre.data.sampler import ORDER_VERSION, shuffle

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


@dataclasses.dataclass(frozen=True)
class _Block:
    """Block `index` of a mixture order: its positions [start, end), the positions each source has in the blocks
    before it (`before`), and per position its source (`slots`) and how many earlier positions of the block that
    source has (`ranks`)."""

    index: int
    start: int
    end: int
    before: np.ndarray
    slots: np.ndarray
    ranks: np.ndarray


class MixtureOrder:
    """Maps global position p to an index into the concatenation of the sources' samples.

    Block b covers positions [start(b), start(b+1)) with start(b) = sum over sources of
    floor(b * BLOCK_SIZE * w_s) and w normalised: so source s gets exactly floor(b * BLOCK_SIZE * w_s)
    of the positions before block b, the long-run share is exactly w_s, and a tiny weight still gets
    its samples (one every few blocks). A block's positions are the sources' counts shuffled by
    (seed, b). Source s's k-th position takes sample k of its own seeded order (`sampler.shuffle` of order
    `version`), so each source runs through its own epochs independently of the others.

    Everything is a function of (seed, sources, p): the order is the same for any layout and a resume
    needs only the number of positions consumed.

    Cost: the block last used is kept with each position's source and rank (`_Block`, O(BLOCK_SIZE + sources)
    memory), so a position in it costs O(1) whatever the number of sources; entering a block costs a few vectorised
    passes over the sources and a sort of its ~1,024 positions, once per ~1,024 positions read in order.
    """

    def __init__(self, sources: list[Source], seed: int, version: int = ORDER_VERSION):
        total = sum(source.weight for source in sources)
        self.sources = sources
        self.rates = np.array([BLOCK_SIZE * source.weight / total for source in sources])
        self.offsets = [0, *np.cumsum([source.num_samples for source in sources]).tolist()]
        # numpy seeds must be non-negative: a negative training.seed maps to a distinct non-negative one.
        self._entropy = seed % 2**64
        self.shuffles = [shuffle(source.num_samples, self._source_seed(i), version) for i, source in enumerate(sources)]
        self._block = self._make_block(0)

    def __call__(self, position: int) -> int:
        block = self._block_at(position)
        offset = position - block.start
        source = int(block.slots[offset])
        k = int(block.before[source]) + int(block.ranks[offset])
        return self.offsets[source] + self.shuffles[source](k)

    def source_counts(self, end: int) -> list[int]:
        """How many of the positions [0, end) each source fills."""
        block = self._block_at(end)
        inside = np.bincount(block.slots[: end - block.start], minlength=len(self.sources))
        return (block.before + inside).tolist()

    def _source_seed(self, source: int) -> int:
        return int(np.random.SeedSequence([self._entropy, _SOURCE_STREAM, source]).generate_state(1)[0])

    def _before(self, block: int) -> np.ndarray:
        """Positions of each source in the blocks before `block`: floor(block * rate), as exact int64."""
        return np.floor(block * self.rates).astype(np.int64)

    def _start(self, block: int) -> int:
        return int(self._before(block).sum())

    def _block_at(self, position: int) -> _Block:
        """The block holding `position`: the one last used, or the one found from position // BLOCK_SIZE (blocks
        hold BLOCK_SIZE +- (sources - 1) positions)."""
        if self._block.start <= position < self._block.end:
            return self._block
        index = position // BLOCK_SIZE
        while self._start(index) > position:
            index -= 1
        while self._start(index + 1) <= position:
            index += 1
        self._block = self._make_block(index)
        return self._block

    def _make_block(self, index: int) -> _Block:
        """Block `index`: its sources' positions shuffled by (seed, index), and each position's rank in its source."""
        before, after = self._before(index), self._before(index + 1)
        slots = np.repeat(np.arange(len(self.sources)), after - before)
        slots = np.random.default_rng([self._entropy, _BLOCK_STREAM, index]).permutation(slots)
        by_source = np.argsort(slots, kind="stable")
        grouped = slots[by_source]
        ranks = np.empty_like(slots)
        ranks[by_source] = np.arange(len(slots)) - np.searchsorted(grouped, grouped, side="left")
        return _Block(index, int(before.sum()), int(after.sum()), before, slots, ranks)
