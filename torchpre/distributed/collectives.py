"""Bucketed collectives on lists of tensors: all-reduce, and reduce-scatter / all-gather of `torch.chunk` chunks.

Data parallelism reduces gradients with them (`torchpre.optim.grad_buckets` through the `*_flat` shims), tensor
parallelism its partial sums, ZeRO its shards. `ChunkLayout` places every rank's chunk of many tensors in one flat
buffer, so that one collective moves them all."""

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


def reduce_scatter_flat(
    out: torch.Tensor, flat: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
) -> dist.Work | None:
    """Sums `flat` (`world` equal sections) over `group` into `out`, this rank's section; `out` may be that
    section of `flat` itself. With `dp_all_reduce_flat` and `all_gather_flat`, the only data-parallel collectives:
    tests count them here."""
    return _reduce_scatter_single(out, flat, group=group, async_op=async_op)


def all_reduce_flat(flat: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False) -> dist.Work | None:
    """Sums `flat` in place over `group`."""
    return dist.all_reduce(flat, group=group, async_op=async_op)


def all_gather_flat(
    out: torch.Tensor, flat: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
) -> dist.Work | None:
    """Every rank's `flat`, in rank order, into `out`."""
    return _all_gather_single(out, flat, group=group, async_op=async_op)


def reduce_scatter_chunks(
    tensors: list[torch.Tensor], dims: list[int], group: dist.ProcessGroup, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> list[torch.Tensor]:
    """For each tensor, this rank's chunk along its dim (`torch.chunk` over the group), summed over the group.

    Many tensors go through one reduce-scatter per bucket: each rank's chunks are packed
    side by side (padded to the largest chunk) into one flat buffer.
    """
    shards: list[torch.Tensor] = []
    for bucket in _buckets(list(zip(tensors, dims)), bucket_bytes):
        layout = ChunkLayout([t.shape for t, _ in bucket], [d for _, d in bucket], dist.get_world_size(group))
        packed = layout.pack([t for t, _ in bucket])
        mine = packed.new_empty(layout.rank_numel)
        reduce_scatter_flat(mine, packed, group)
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
        layout = ChunkLayout([o.shape for o in bucket_outputs], [d for _, _, d in bucket], dist.get_world_size(group))
        all_gather_into(layout, [s for _, s, _ in bucket], bucket_outputs, group)


def all_gather_into(
    layout: "ChunkLayout", shards: list[torch.Tensor], outputs: list[torch.Tensor], group: dist.ProcessGroup
) -> None:
    """Writes every rank's chunks (`shards` here, cast to the outputs' dtype) into the full `outputs`: one
    all-gather of `layout`'s flat buffer."""
    mine = layout.pack_rank([s.to(o.dtype) for o, s in zip(outputs, shards)])
    gathered = mine.new_empty(layout.rank_numel * layout.world_size)
    all_gather_flat(gathered, mine, group)
    layout.unpack_all(gathered, outputs)


class ChunkLayout:
    """Where each rank's chunk of each tensor sits in a flat buffer of `world_size` equal sections (rank-major):
    section r holds, tensor after tensor, `torch.chunk(tensor, world_size, dim)[r]` padded to the largest chunk.

    Every method moves a tensor's chunks of all ranks with at most two strided copies (the full chunks, then the
    shorter last one), never a loop over ranks. With `world_size` 1 the buffer is the tensors concatenated.
    """

    def __init__(self, shapes: list[torch.Size], dims: list[int], world_size: int):
        self.world_size = world_size
        self.dims = dims
        self.shapes = [torch.Size(shape) for shape in shapes]
        self.padded = [_padded_chunk_shape(shape, d, world_size) for shape, d in zip(self.shapes, dims)]
        self.numels = [math.prod(shape) for shape in self.padded]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.numels))]
        self.rank_numel = sum(self.numels)

    def rank_view(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Tensor `index`'s padded chunks of every rank in `flat`, as one strided view [world, *padded chunk]."""
        start = self.offsets[index]
        sections = flat.view(self.world_size, self.rank_numel)
        return sections[:, start : start + self.numels[index]].unflatten(1, self.padded[index])

    def _pairs(self, flat: torch.Tensor, index: int, tensor: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(slots in `flat`, chunks of `tensor`) view pairs covering every element of `tensor` once: the ranks
        with full chunks in one pair, the rank with the shorter last chunk (if any) in a second."""
        dim, size = self.dims[index], self.shapes[index][self.dims[index]]
        per = self.padded[index][dim]
        if per == 0:
            return []
        slots = self.rank_view(flat, index)
        full = size // per
        pairs = [(slots[:full], tensor.narrow(dim, 0, full * per).unflatten(dim, (full, per)).movedim(dim, 0))]
        if size > full * per:
            rest = size - full * per
            pairs.append((slots[full].narrow(dim, 0, rest), tensor.narrow(dim, full * per, rest)))
        return pairs

    def add_into(self, flat: torch.Tensor, index: int, tensor: torch.Tensor) -> None:
        """Adds `tensor` (shaped like tensor `index`) into its chunks' slots of `flat`."""
        for slot, chunk in self._pairs(flat, index, tensor):
            slot.add_(chunk)

    def pack(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        flat = tensors[0].new_zeros(self.rank_numel * self.world_size)
        for i, tensor in enumerate(tensors):
            for slot, chunk in self._pairs(flat, i, tensor):
                slot.copy_(chunk)
        return flat

    def pack_rank(self, chunks: list[torch.Tensor]) -> torch.Tensor:
        flat = chunks[0].new_zeros(self.rank_numel)
        for slot, chunk, dim in zip(self._slots(flat), chunks, self.dims):
            slot.narrow(dim, 0, chunk.shape[dim]).copy_(chunk)
        return flat

    def unpack_rank(self, section: torch.Tensor, rank: int) -> list[torch.Tensor]:
        """Views of this rank's chunks in its `section` (rank_numel elements)."""
        return [
            slot.narrow(dim, 0, chunk_rows(shape[dim], self.world_size, rank))
            for slot, dim, shape in zip(self._slots(section), self.dims, self.shapes)
        ]

    def unpack_all(self, flat: torch.Tensor, outputs: list[torch.Tensor]) -> None:
        for i, output in enumerate(outputs):
            for slot, chunk in self._pairs(flat, i, output):
                chunk.copy_(slot)

    def _slots(self, section: torch.Tensor) -> list[torch.Tensor]:
        """Views of one rank's section, one per tensor, in the padded chunk shape."""
        return [s.view(shape) for s, shape in zip(section.split(self.numels), self.padded)]


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
