"""Fixtures shared by the unit tests."""

import pytest
import torch.distributed as dist


@pytest.fixture
def world():
    """A process group of one (in-memory store), for code that runs collectives."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
