"""Bucketed reduce-scatter / all-gather of per-tensor chunks, with uneven and empty chunks."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from tests.launch import spawn
from torchpre.distributed.collectives import all_gather_chunks, reduce_scatter_chunks

pytestmark = pytest.mark.slow

# (shape, dim): even, uneven (5 rows over 2 ranks), a 1-row tensor whose second chunk is empty, dim 1
SHAPES = [((4, 3), 0), ((5, 2), 0), ((1, 4), 0), ((3, 7), 1), ((6,), 0)]


def _check(mesh: DeviceMesh) -> None:
    group, rank, world = mesh.get_group(), dist.get_rank(), dist.get_world_size()
    tensors = [torch.randn(shape, generator=torch.Generator().manual_seed(10 * rank + i)) for i, (shape, _) in
               enumerate(SHAPES)]
    dims = [d for _, d in SHAPES]
    expected_sum = [sum(torch.randn(shape, generator=torch.Generator().manual_seed(10 * r + i)) for r in range(world))
                    for i, (shape, _) in enumerate(SHAPES)]
    # a tiny bucket forces several collectives
    for bucket_bytes in (1 << 20, 40):
        shards = reduce_scatter_chunks([t.clone() for t in tensors], dims, group, bucket_bytes)
        for shard, total, dim in zip(shards, expected_sum, dims):
            chunks = torch.chunk(total, world, dim)
            mine = chunks[rank] if rank < len(chunks) else total.narrow(dim, 0, 0)
            torch.testing.assert_close(shard, mine, rtol=1e-6, atol=1e-6)
        outputs = [torch.zeros(shape, dtype=torch.bfloat16) for shape, _ in SHAPES]
        all_gather_chunks(shards, outputs, dims, group, bucket_bytes)
        for output, total in zip(outputs, expected_sum):
            torch.testing.assert_close(output, total.to(torch.bfloat16), rtol=0, atol=0)


def test_reduce_scatter_and_all_gather_chunks(tmp_path):
    spawn(_check, world_size=2, store_path=tmp_path / "store")
