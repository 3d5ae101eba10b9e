"""The vectorised `ChunkLayout` against the per-rank loop it replaced, bitwise: ZeRO checkpoints store shards cut
as `torch.chunk` cuts them, so moving a value by one element would corrupt every resumed run."""

import math

import pytest
import torch

from torchpre.distributed.collectives import ChunkLayout, chunk_rows, rank_chunk

# (shape, dim): even, uneven (5 rows), a 1-row tensor whose later chunks are empty, dim 1, a vector
SHAPES = [((4, 3), 0), ((5, 2), 0), ((1, 4), 0), ((3, 7), 1), ((6,), 0)]


class LoopLayout:
    """The implementation before issue 17 (a Python loop over ranks x tensors), kept as the reference."""

    def __init__(self, tensors, dims, world_size):
        self.world_size, self.dims = world_size, dims
        self.shapes = [t.shape for t in tensors]
        self.padded = []
        for t, d in zip(tensors, dims):
            padded = list(t.shape)
            padded[d] = math.ceil(t.shape[d] / world_size)
            self.padded.append(torch.Size(padded))
        self.numels = [math.prod(shape) for shape in self.padded]
        self.rank_numel = sum(self.numels)

    def _slots(self, section):
        return [s.view(shape) for s, shape in zip(section.split(self.numels), self.padded)]

    def _chunk(self, slot, index, rank):
        return slot.narrow(self.dims[index], 0, chunk_rows(self.shapes[index][self.dims[index]], self.world_size, rank))

    def pack(self, tensors):
        flat = tensors[0].new_zeros(self.rank_numel * self.world_size)
        for rank, section in enumerate(flat.split(self.rank_numel)):
            for i, (slot, tensor) in enumerate(zip(self._slots(section), tensors)):
                self._chunk(slot, i, rank).copy_(rank_chunk(tensor, self.dims[i], self.world_size, rank))
        return flat

    def unpack_rank(self, section, rank):
        return [self._chunk(slot, i, rank) for i, slot in enumerate(self._slots(section))]

    def unpack_all(self, flat, outputs):
        for rank, section in enumerate(flat.split(self.rank_numel)):
            for i, slot in enumerate(self._slots(section)):
                rank_chunk(outputs[i], self.dims[i], self.world_size, rank).copy_(self._chunk(slot, i, rank))


def _tensors(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape, _ in SHAPES]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_the_vectorised_layout_equals_the_loop_bitwise(world):
    tensors, dims = _tensors(0), [d for _, d in SHAPES]
    layout, reference = ChunkLayout([t.shape for t in tensors], dims, world), LoopLayout(tensors, dims, world)
    packed = layout.pack(tensors)
    assert torch.equal(packed, reference.pack(tensors))

    added = torch.zeros_like(packed)
    for i, tensor in enumerate(tensors):
        layout.add_into(added, i, tensor)
        layout.add_into(added, i, tensor)
    assert torch.equal(added, reference.pack([2 * t for t in tensors]))

    for rank, section in enumerate(packed.split(layout.rank_numel)):
        mine, expected = layout.unpack_rank(section, rank), reference.unpack_rank(section, rank)
        assert [m.shape for m in mine] == [e.shape for e in expected]
        assert all(torch.equal(m, e) for m, e in zip(mine, expected))
        assert torch.equal(layout.pack_rank(mine), section)

    outputs, expected = [torch.zeros_like(t) for t in tensors], [torch.zeros_like(t) for t in tensors]
    layout.unpack_all(packed, outputs)
    reference.unpack_all(packed, expected)
    assert all(torch.equal(o, e) and torch.equal(o, t) for o, e, t in zip(outputs, expected, tensors))


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("shape, dim", SHAPES)
def test_rank_chunk_is_torch_chunk_of_that_rank(shape, dim, world_size):
    """The ZeRO masters' shards (`DistributedOptimizer`) are cut by `rank_chunk`: each rank's rows must be exactly
    `torch.chunk`'s, the same rows DTensor's Shard gives that rank, and empty past the last non-empty chunk."""
    tensor = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    chunks = torch.chunk(tensor, world_size, dim)
    for rank in range(world_size):
        expected = chunks[rank] if rank < len(chunks) else tensor.narrow(dim, 0, 0)
        assert torch.equal(rank_chunk(tensor, dim, world_size, rank), expected), (rank, shape, dim)
        assert chunk_rows(shape[dim], world_size, rank) == expected.shape[dim]
