"""`WholeMatrices` on 4 gloo ranks: every layout the optimizer's state takes (ZeRO over DP, TP, ZeRO within TP
shards, uneven chunks, experts over ep with ZeRO over edp, replicas) is assembled into the matrix one process
holds, and each rank gets back exactly its shard of the function's result; the bytes sent are the theory's."""

import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from tests.launch import spawn
from torchpre.optim.whole_matrices import WholeMatrices

pytestmark = pytest.mark.slow

# (global shape, placements over the (dp, tp) mesh), as DistributedOptimizer lays out a master
LAYOUTS = [
    ((8, 6), (Shard(0), Shard(1))),  # ZeRO-1 (dim 0) of a row-parallel weight
    ((7, 5), (Shard(0), Shard(1))),  # uneven chunks on both
    ((8, 6), (_StridedShard(0, split_factor=2), Shard(0))),  # ZeRO-1 within a column-parallel weight's TP shard
    ((6, 10), (Replicate(), Shard(1))),  # ZeRO-0 under TP: two replica groups of 2
    ((10, 4), (Shard(0), Replicate())),  # ZeRO-1, replicated over TP: two groups of 2
    ((4, 6, 8), (Shard(1), Shard(0))),  # experts: ZeRO over edp (dim 1), 2 experts per ep rank (dim 0)
    ((3, 3), (Replicate(), Replicate())),  # whole on every rank: transformed where it is
]


def _whole_function(block: torch.Tensor) -> torch.Tensor:
    """Depends on every element of each matrix (a shard-local version gets it wrong)."""
    return block.cumsum(-1) - 2 * block.cumsum(-2) + block.sum(dim=(-2, -1), keepdim=True)


def _full(shape: tuple[int, ...], k: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(k))


def _shard(mesh: DeviceMesh, tensor: torch.Tensor, placements) -> torch.Tensor:
    return (
        DTensor.from_local(tensor, mesh, [Replicate(), Replicate()], run_check=False)
        .redistribute(mesh, placements)
        .to_local()
    )


def assemble(mesh: DeviceMesh) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    shards, layouts, expected = [], [], []
    for k, (shape, placements) in enumerate(LAYOUTS):
        full = _full(shape, k)
        local = _shard(mesh, full, placements)
        shards.append(local)
        layouts.append(DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape,
                                          stride=full.stride()))  # fmt: skip
        expected.append(_shard(mesh, _whole_function(full), placements))
    whole = WholeMatrices(layouts, torch.device("cpu"))
    for _ in range(2):  # the routes are built on the first call and reused
        results = whole.apply(_whole_function, shards)
        for (shape, placements), result, want in zip(LAYOUTS, results, expected):
            assert torch.equal(result, want), (shape, placements)
    # Every matrix but the replicated one is split over a group of g ranks: its owner receives the g - 1 other
    # shards and sends them back their results, so the world sends 2 * (numel - owner's shard) per group.
    total = torch.tensor([whole.sent_bytes])
    dist.all_reduce(total)
    theory = 0
    for k, (shape, placements) in enumerate(LAYOUTS):
        matrix = whole.matrices[k]
        owner_numel = torch.tensor([shards[k].numel() if matrix.owner == dist.get_rank() else 0])
        dist.all_reduce(owner_numel)  # summed over the groups' owners
        groups = mesh.size() // len(matrix.members)
        theory += 2 * (groups * matrix.block.numel() - owner_numel.item()) * 4 if len(matrix.members) > 1 else 0
    assert total.item() == theory


def test_every_layout_is_assembled_and_returned(tmp_path: Path):
    spawn(functools.partial(assemble), 4, tmp_path / "store")


def owners_balance(mesh: DeviceMesh) -> None:
    """Owners are spread by size: 8 equal matrices over a group of 4 give each rank 2 to transform."""
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    layouts = [DTensor.from_local(torch.zeros(2, 8), mesh, [Shard(0)], run_check=False, shape=torch.Size((8, 8)),
                                  stride=(8, 1)) for _ in range(8)]  # fmt: skip
    whole = WholeMatrices(layouts, torch.device("cpu"))
    assert [m.owner for m in whole.matrices].count(dist.get_rank()) == 2


def test_owners_are_balanced(tmp_path: Path):
    spawn(owners_balance, 4, tmp_path / "store")
