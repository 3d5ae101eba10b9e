"""How ZeRO-1 declares the optimizer state of a tensor whose only dimension tensor parallelism shards, checked on
one rank of a dp3 x tp2 job under torch's fake process group (no collectives run)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from torchpre.distributed.parallel_dims import ParallelDims
from torchpre.errors import ConfigError
from torchpre.optim import build_optimizer
from torchpre.parallel import ParallelPlan, parallelize


class OneLayer(nn.Module):
    def __init__(self, out_features: int):
        super().__init__()
        self.layers = nn.ModuleDict({"0": nn.Linear(8, out_features)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers["0"](x)


@pytest.fixture
def dp3_tp2():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=6)
    try:
        yield ParallelDims.from_degrees(dp=3, tp=2, pp=1, world_size=6).build_mesh("cpu")
    finally:
        dist.destroy_process_group()


def zero1_state(mesh, out_features: int) -> dict:
    with torch.device("meta"):
        model = OneLayer(out_features)
    plan = ParallelPlan(tensor_parallel={"layers.0": ColwiseParallel()})
    model = parallelize(model, mesh, plan, device=torch.device("cpu"), init_weights=lambda m: None)
    return build_optimizer(model, zero_stage=1).state_dict()


def test_a_column_parallel_bias_is_declared_tp_first(dp3_tp2):
    state = zero1_state(dp3_tp2, 12)["layers.0.bias"]["exp_avg"]
    assert state.placements == (_StridedShard(0, split_factor=2), Shard(0))
    assert state.to_local().shape == (2,)  # 12 / tp2 = 6 per TP rank, / dp3 = 2


def test_a_size_dtensor_would_cut_differently_is_an_error_naming_the_parameter(dp3_tp2):
    with pytest.raises(ConfigError, match="'layers.0.bias'.*not divisible by dp x tp = 6"):
        zero1_state(dp3_tp2, 14)
