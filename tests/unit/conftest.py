"""Fixtures shared by the unit tests."""

import pytest
import torch.distributed as dist

from torchpre.distributed.parallel_dims import ParallelDims


@pytest.fixture
def world():
    """A process group of one (in-memory store), for code that runs collectives."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.fixture
def mesh(world):
    """The ("pp", "dp", "tp") mesh of a process group of one, for `parallelize` in one process."""
    return ParallelDims.from_degrees(dp=1, tp=1, pp=1, world_size=1).build_mesh("cpu")
