"""Shared Parameters through `parallelize` (torchpre.parallel.ties): found on the model as given, kept one Parameter
after materialising, and refused by name where a layout cannot keep them one weight. The end-to-end proof (an
unmodified tied transformers Phi-3 at dp2, bitwise equal to plain transformers) is in
tests/distributed/test_hf_parallelize_api.py."""

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.testing._internal.distributed.fake_pg import FakeStore

from torchpre.distributed.parallel_dims import ParallelDims
from torchpre.errors import ConfigError
from torchpre.parallel import ParallelPlan, parallelize
from torchpre.parallel.ties import cross_stage_pair, shared_parameters, tie_groups

STAGES = [["embed", "blocks.0"], ["blocks.1"], ["blocks.2", "head"]]


class TiedToy(nn.Module):
    """An embedding and an output layer that share one Parameter, as transformers' tie_word_embeddings makes them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def meta_toy() -> TiedToy:
    with torch.device("meta"):
        return TiedToy()


def test_shared_parameters_are_read_off_the_meta_model():
    assert shared_parameters(meta_toy()) == [("embed.weight", "head.weight")]
    assert tie_groups(meta_toy(), ("blocks.0.weight", "blocks.2.weight")) == [
        ("embed.weight", "head.weight"),
        ("blocks.0.weight", "blocks.2.weight"),
    ]


def test_parallelize_keeps_a_tie_nobody_declared(mesh: DeviceMesh):
    """`to_empty` gives each module a Parameter of its own; the tie found on the meta model comes back."""
    parallel = parallelize(meta_toy(), mesh, ParallelPlan(), device=torch.device("cpu"), init_weights=lambda m: None)
    (part,) = parallel.parts
    assert part.head.weight is part.embed.weight
    assert [name for name, _ in parallel.named_parameters()].count("head.weight") == 0  # one Parameter, one name


def test_a_tie_across_the_first_and_last_stage_is_the_pair_whose_gradients_are_summed():
    assert cross_stage_pair(shared_parameters(meta_toy()), STAGES) == ("embed.weight", "head.weight")
    assert cross_stage_pair(shared_parameters(meta_toy()), [sum(STAGES, [])]) is None  # one stage holds both


@pytest.mark.parametrize(
    "groups, match",
    [
        ([("embed.weight", "blocks.1.weight")], r"embed.weight on stage\(s\) 0; blocks.1.weight on stage\(s\) 1 of 3"),
        ([("embed.weight", "blocks.1.weight", "head.weight")], "embed.weight, blocks.1.weight, head.weight"),
        ([("embed.weight", "head.weight"), ("blocks.0.weight", "blocks.2.weight")], "shares 2 Parameters across"),
    ],
)
def test_ties_the_pipeline_cannot_keep_are_refused_by_name(groups, match):
    with pytest.raises(ConfigError, match=match):
        cross_stage_pair(groups, STAGES)


@pytest.fixture
def fake_tp2_mesh() -> Iterator[DeviceMesh]:
    """Rank 0 of two under torch's fake process group: the plan is really applied (on the meta device)."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield ParallelDims.from_degrees(dp=1, tp=2, pp=1, world_size=2).build_mesh("cpu")
    finally:
        dist.destroy_process_group()


def test_a_tensor_parallel_plan_sharding_one_copy_only_is_refused_by_name(fake_tp2_mesh: DeviceMesh):
    """The head column-parallel (Shard(0)) and the embedding replicated cannot be one Parameter again."""
    plan = ParallelPlan(tensor_parallel={"head": ColwiseParallel()})
    with pytest.raises(ConfigError, match=r"shares one Parameter between embed.weight, head.weight.*replicated"):
        parallelize(meta_toy(), fake_tp2_mesh, plan, device=torch.device("cpu"), init_weights=lambda m: None)
