"""Layout validation and batch arithmetic: each error names the keys and the fix."""

import pytest
import torch.distributed as dist

from torchpre.distributed.parallel_dims import ParallelDims
from torchpre.errors import ConfigError
from torchpre.training.batches import resolve_batch_sizes


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


def test_hsdp_degrees_resolve_and_must_multiply_to_dp():
    dims = ParallelDims.from_degrees(-1, 2, 1, 8, dp_replicate=2)
    assert (dims.dp, dims.dp_replicate, dims.dp_shard) == (4, 2, 2)
    assert ParallelDims.from_degrees(4, 1, 1, 4).dp_shard == 4
    with pytest.raises(ConfigError, match=r"replicate_degree = 3 must divide the data-parallel degree 4"):
        ParallelDims.from_degrees(-1, 1, 1, 4, dp_replicate=3)
    with pytest.raises(ConfigError, match=r"2 x 1 = 2 must equal the data-parallel degree 4"):
        ParallelDims.from_degrees(-1, 1, 1, 4, dp_replicate=2, dp_shard=1)
    with pytest.raises(ConfigError, match=r"expert_parallel_degree = 4 must divide data_parallel_shard_degree = 2"):
        ParallelDims.from_degrees(-1, 1, 1, 8, ep=4, dp_replicate=4)


@pytest.fixture
def fake_world_16():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=13, world_size=16)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_mesh_views_share_ranks_row_major(fake_world_16):
    """pp2 x (replicate 2 x shard 2) x tp2 at global rank 13 = (pp 1, replicate 1, shard 0, tp 1): its dp rank is
    replicate x shard degree + shard = 2 in the plain mesh too, and FSDP gets the 2-D (replicate, shard) view."""
    dims = ParallelDims.from_degrees(-1, 2, 2, 16, dp_replicate=2)
    meshes = dims.build_meshes("cpu", fsdp=True)
    mesh, dense = meshes.mesh, meshes.dense_mesh
    assert mesh.mesh_dim_names == ("pp", "dp", "tp") and mesh.shape == (2, 4, 2)
    assert dense.mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "tp") and dense.shape == (2, 2, 2, 2)
    assert [mesh[n].get_local_rank() for n in ("pp", "dp", "tp")] == [1, 2, 1]
    assert [dense[n].get_local_rank() for n in ("dp_replicate", "dp_shard")] == [1, 0]
    assert meshes.fsdp_mesh.mesh_dim_names == ("dp_replicate", "dp_shard")
    assert dims.build_meshes("cpu").dense_mesh is None


def test_expert_mesh_views_carve_ep_from_the_shard_dim(fake_world_16):
    """pp2 x (replicate 2 x shard 2) x tp2 with ep2 at rank 13: the experts' FSDP shards over edp_shard = 1 rank
    within a replica group; the ZeRO 0-2 expert mesh keeps edp = dp / ep = 2, ep rank = dp rank % ep = 0."""
    meshes = ParallelDims.from_degrees(-1, 2, 2, 16, ep=2, dp_replicate=2).build_meshes("cpu", fsdp=True)
    assert meshes.expert_mesh.shape == (2, 2, 2, 2) and meshes.expert_mesh["ep"].get_local_rank() == 0
    dense = meshes.expert_dense_mesh
    assert dense.mesh_dim_names == ("pp", "dp_replicate", "edp_shard", "ep", "tp") and dense.shape == (2, 2, 1, 2, 2)
    assert meshes.expert_fsdp_mesh.mesh_dim_names == ("dp_replicate", "edp_shard")
    assert resolve_batch_sizes(4, -1, 2) == (8, 1)
    assert resolve_batch_sizes(4, 32, 2) == (32, 4)


def test_global_batch_that_does_not_divide():
    with pytest.raises(ConfigError, match=r"global_batch_size = 20 is not divisible .* 4 x 2 = 8"):
        resolve_batch_sizes(4, 20, 2)


def test_context_parallel_ranks_reduce_and_shard_with_data_parallel(fake_world_16):
    """pp2 x dp2 x cp2 x tp2 at rank 13 = (pp 1, dp 1, cp 0, tp 1): the gradient views' dp spans dp x cp = 4 ranks
    (cp innermost, so this rank is dp coordinate 1 x 2 + 0 = 2 there), ZeRO-3 shards over dp_shard x cp, and the
    context mesh tells the data coordinate (dp 1: the sequences it reads) from the cp coordinate (its part of them)."""
    dims = ParallelDims.from_degrees(-1, 2, 2, 16, cp=2)
    assert (dims.dp, dims.cp) == (2, 2)
    meshes = dims.build_meshes("cpu", fsdp=True)
    assert meshes.mesh.shape == (2, 4, 2) and meshes.mesh["dp"].get_local_rank() == 2
    assert meshes.dense_mesh["dp_shard"].size() == 4
    context = meshes.context_mesh
    assert context.mesh_dim_names == ("pp", "dp", "cp", "tp") and context.shape == (2, 2, 2, 2)
    assert context["cp"].get_local_rank() == 0 and meshes.data_rank() == (1, 2)
    assert ParallelDims.from_degrees(-1, 2, 2, 16).build_meshes("cpu").context_mesh is None


def test_context_parallel_degree_must_divide_the_world():
    with pytest.raises(ConfigError, match=r"world size 6 is not divisible by .*context_parallel_degree = 1 x 1 x 4"):
        ParallelDims.from_degrees(-1, 1, 1, 6, cp=4)
    with pytest.raises(ConfigError, match=r"context_parallel_degree = 0"):
        ParallelDims.from_degrees(-1, 1, 1, 2, cp=0)
    with pytest.raises(ConfigError, match=r"dp x tp x pp x cp = 2 x 1 x 1 x cp 2 = 4 does not match the 2"):
        ParallelDims.from_degrees(2, 1, 1, 2, cp=2)
