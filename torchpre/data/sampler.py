"""The order of samples: a function of the seed over global sample positions, not of the layout."""

from collections.abc import Callable, Iterator

import torch

# Maps a global sample position (0, 1, 2, ... over the whole run) to the index of the sample there.
SampleOrder = Callable[[int], int]


class EpochShuffle:
    """Position p is sample permutation_e[p mod n] of epoch e = p // n: every sample once per epoch, in
    an order drawn anew each epoch from `seed + e`.

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
