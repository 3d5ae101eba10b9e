"""Data-parallel gradient synchronisation over the `dp` mesh dimension."""

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor

DEFAULT_BUCKET_BYTES = 25 * 2**20


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def all_reduce_gradients(
    params: Iterable[torch.nn.Parameter], group: dist.ProcessGroup, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> None:
    """Sums the gradients of `params` over `group`, a few large collectives instead of one each.

    Called once per optimizer step, after gradient accumulation. The loss is already divided by the
    global token count, so summing (not averaging) yields the global-batch gradient.
    """
    all_reduce_tensors([_local(p.grad) for p in params if p.grad is not None], group, bucket_bytes)


def all_reduce_tensors(
    tensors: list[torch.Tensor], group: dist.ProcessGroup, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> None:
    """Sums `tensors` in place over `group`, bucketed into flat buffers."""
    if dist.get_world_size(group) == 1:
        return
    for bucket in _buckets(tensors, bucket_bytes):
        flat = _flatten_dense_tensors(bucket)
        dist.all_reduce(flat, group=group)
        for tensor, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            tensor.copy_(synced)


def _buckets(tensors: list[torch.Tensor], bucket_bytes: int) -> Iterable[list[torch.Tensor]]:
    """Consecutive groups of same-dtype tensors of about `bucket_bytes` each."""
    bucket: list[torch.Tensor] = []
    size = 0
    for tensor in tensors:
        if bucket and (size + tensor.nbytes > bucket_bytes or tensor.dtype != bucket[0].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(tensor)
        size += tensor.nbytes
    if bucket:
        yield bucket
