"""Bucketed collectives on lists of tensors: all-reduce, and reduce-scatter / all-gather of `torch.chunk` chunks.

Data parallelism reduces gradients with them, tensor parallelism its partial sums, ZeRO-1 its shards."""

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

DEFAULT_BUCKET_BYTES = 25 * 2**20
# torch 2.14 renamed the flat-tensor collectives (the old names warn on every call); older torch has only those.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_reduce_tensors(
    tensors: list[torch.Tensor], group: dist.ProcessGroup, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> None:
    """Sums `tensors` in place over `group`, a few large collectives instead of one per tensor."""
    if dist.get_world_size(group) == 1:
        return
    for bucket in _buckets(tensors, bucket_bytes):
        flat = _flatten_dense_tensors(bucket)
        dist.all_reduce(flat, group=group)
        for tensor, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            tensor.copy_(synced)


def _buckets(items: list, bucket_bytes: int) -> Iterable[list]:
    """Consecutive groups of about `bucket_bytes` each, never mixing dtypes. An item is a tensor, or
    a tuple whose first element is the tensor that counts."""
    bucket: list = []
    size, dtype = 0, None
    for item in items:
        tensor = item[0] if isinstance(item, tuple) else item
        if bucket and (size + tensor.nbytes > bucket_bytes or tensor.dtype != dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(item)
        size, dtype = size + tensor.nbytes, tensor.dtype
    if bucket:
        yield bucket


def reduce_scatter_chunks(
    tensors: list[torch.Tensor], dims: list[int], group: dist.ProcessGroup, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> list[torch.Tensor]:
    """For each tensor, this rank's chunk along its dim (`torch.chunk` over the group), summed over the group.

    Many tensors go through one reduce-scatter per bucket: each rank's chunks are packed
    side by side (padded to the largest chunk) into one flat buffer.
    """
    shards: list[torch.Tensor] = []
    for bucket in _buckets(list(zip(tensors, dims)), bucket_bytes):
        layout = _ChunkLayout([t for t, _ in bucket], [d for _, d in bucket], dist.get_world_size(group))
        packed = layout.pack([t for t, _ in bucket])
        mine = packed.new_empty(layout.rank_numel)
        _reduce_scatter_single(mine, packed, group=group)
        shards.extend(layout.unpack_rank(mine, dist.get_rank(group)))
    return shards


def all_gather_chunks(
    shards: list[torch.Tensor],
    outputs: list[torch.Tensor],
    dims: list[int],
    group: dist.ProcessGroup,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> None:
    """The inverse of `reduce_scatter_chunks`: writes every rank's chunk into `outputs` (cast to their dtype)."""
    # Buckets are cut by the full outputs, which are the same on every rank (the shards may not be).
    items = list(zip(outputs, shards, dims))
    for bucket in _buckets(items, bucket_bytes):
        bucket_outputs = [o for o, _, _ in bucket]
        layout = _ChunkLayout(bucket_outputs, [d for _, _, d in bucket], dist.get_world_size(group))
        mine = layout.pack_rank([s.to(o.dtype) for o, s, _ in bucket])
        gathered = mine.new_empty(layout.rank_numel * layout.world_size)
        _all_gather_single(gathered, mine, group=group)
        layout.unpack_all(gathered, bucket_outputs)


class _ChunkLayout:
    """Where each rank's chunk of each tensor sits in a flat buffer of `world_size` equal sections."""

    def __init__(self, tensors: list[torch.Tensor], dims: list[int], world_size: int):
        self.world_size = world_size
        self.dims = dims
        self.shapes = [t.shape for t in tensors]
        self.padded = [_padded_chunk_shape(t.shape, d, world_size) for t, d in zip(tensors, dims)]
        self.numels = [math.prod(shape) for shape in self.padded]
        self.rank_numel = sum(self.numels)

    def _slots(self, section: torch.Tensor) -> list[torch.Tensor]:
        """Views of one rank's section, one per tensor, in the padded chunk shape."""
        return [s.view(shape) for s, shape in zip(section.split(self.numels), self.padded)]

    def _chunk(self, slot: torch.Tensor, index: int, rank: int) -> torch.Tensor:
        rows = chunk_rows(self.shapes[index][self.dims[index]], self.world_size, rank)
        return slot.narrow(self.dims[index], 0, rows)

    def pack(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        flat = tensors[0].new_zeros(self.rank_numel * self.world_size)
        for rank, section in enumerate(flat.split(self.rank_numel)):
            for i, (slot, tensor) in enumerate(zip(self._slots(section), tensors)):
                self._chunk(slot, i, rank).copy_(rank_chunk(tensor, self.dims[i], self.world_size, rank))
        return flat

    def pack_rank(self, chunks: list[torch.Tensor]) -> torch.Tensor:
        flat = chunks[0].new_zeros(self.rank_numel)
        for slot, chunk, dim in zip(self._slots(flat), chunks, self.dims):
            slot.narrow(dim, 0, chunk.shape[dim]).copy_(chunk)
        return flat

    def unpack_rank(self, section: torch.Tensor, rank: int) -> list[torch.Tensor]:
        return [self._chunk(slot, i, rank) for i, slot in enumerate(self._slots(section))]

    def unpack_all(self, flat: torch.Tensor, outputs: list[torch.Tensor]) -> None:
        for rank, section in enumerate(flat.split(self.rank_numel)):
            for i, slot in enumerate(self._slots(section)):
                rank_chunk(outputs[i], self.dims[i], self.world_size, rank).copy_(self._chunk(slot, i, rank))


def chunk_rows(size: int, world_size: int, rank: int) -> int:
    """Rows of `torch.chunk(size, world_size)[rank]`, 0 past the last non-empty chunk (DTensor Shard semantics)."""
    per_chunk = math.ceil(size / world_size)
    return max(0, min(per_chunk, size - rank * per_chunk))


def rank_chunk(tensor: torch.Tensor, dim: int, world_size: int, rank: int) -> torch.Tensor:
    """`torch.chunk(tensor, world_size, dim)[rank]` as a view, empty past the last non-empty chunk."""
    per_chunk = math.ceil(tensor.shape[dim] / world_size)
    start = min(rank * per_chunk, tensor.shape[dim])
    return tensor.narrow(dim, start, chunk_rows(tensor.shape[dim], world_size, rank))


def _padded_chunk_shape(shape: torch.Size, dim: int, world_size: int) -> torch.Size:
    padded = list(shape)
    padded[dim] = math.ceil(shape[dim] / world_size)
    return torch.Size(padded)
