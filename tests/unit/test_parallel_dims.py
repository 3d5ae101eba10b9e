"""Layout validation and batch arithmetic: each error names the keys and the fix."""

import pytest

from torchpre.distributed.parallel_dims import ParallelDims
from torchpre.errors import ConfigError
from torchpre.trainer import resolve_batch_sizes


def test_dp_minus_one_takes_the_remaining_processes():
    assert ParallelDims.from_degrees(-1, 2, 2, 8) == ParallelDims(dp=2, tp=2, pp=2, world_size=8)
    assert ParallelDims.from_degrees(-1, 1, 1, 1).dp == 1


def test_layout_that_does_not_fit_the_world_size():
    with pytest.raises(ConfigError, match=r"dp x tp x pp = 2 x 1 x 1 = 2 does not match the 4 launched"):
        ParallelDims.from_degrees(2, 1, 1, 4)
    with pytest.raises(ConfigError, match=r"world size 3 is not divisible by .* 2 x 1"):
        ParallelDims.from_degrees(-1, 2, 1, 3)
    with pytest.raises(ConfigError, match="tensor_parallel_degree = 0"):
        ParallelDims.from_degrees(-1, 0, 1, 2)
    with pytest.raises(ConfigError, match="data_parallel_degree = -3"):
        ParallelDims.from_degrees(-3, 1, 1, 2)


def test_global_batch_resolves_to_accumulation_steps():
    assert resolve_batch_sizes(4, -1, 2) == (8, 1)
    assert resolve_batch_sizes(4, 32, 2) == (32, 4)


def test_global_batch_that_does_not_divide():
    with pytest.raises(ConfigError, match=r"global_batch_size = 20 is not divisible .* 4 x 2 = 8"):
        resolve_batch_sizes(4, 20, 2)
