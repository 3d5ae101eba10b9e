"""The MoE balancing step on two processes that routed different tokens: each rank's routing biases move by the job's
token counts, not its own, and end identical on both (the mutation check's `moe-bias-from-local-counts`)."""

import dataclasses
import functools
from pathlib import Path

import torch
import torch.distributed as dist

from tests.launch import spawn
from torchpre.models.moe.args import MOE_FLAVORS
from torchpre.models.moe.model import MoETransformer
from torchpre.models.moe.router import update_expert_bias

ARGS = dataclasses.replace(MOE_FLAVORS["tiny_dsv3"], vocab_size=256)
# Per rank, layer 1's assignments per expert this step; summed they are [4, 4, 2, 6, 4, 4, 4, 4] (mean 4), while
# each rank's own counts alone would move experts 0, 1, 4 and 5 too.
COUNTS = ([3.0, 1, 1, 3, 2, 2, 2, 2], [1.0, 3, 1, 3, 2, 2, 2, 2])


def step_biases(out: Path, mesh) -> None:
    model = MoETransformer(ARGS)
    model.init_weights(0)
    rank = dist.get_rank()
    model.layers["1"].moe.step_tokens_per_expert.copy_(torch.tensor(COUNTS[rank]))
    model.layers["2"].moe.step_tokens_per_expert.fill_(rank)  # uneven on each rank, even in the sum
    update_expert_bias([model], ARGS, torch.device("cpu"), skip=0.0)
    biases = {name: moe.expert_bias.clone() for name, moe in model.moe_layers_by_id()}
    torch.save(biases, out / f"rank{rank}.pt")


def test_biases_move_by_the_job_wide_counts_and_agree_on_every_rank(tmp_path):
    spawn(functools.partial(step_biases, tmp_path), 2, tmp_path / "store")
    rate = ARGS.bias_update_rate
    expected = {1: torch.tensor([0.0, 0, rate, -rate, 0, 0, 0, 0]), 2: torch.zeros(8)}
    for rank in range(2):
        biases = torch.load(tmp_path / f"rank{rank}.pt")
        assert biases.keys() == expected.keys()
        for layer, bias in expected.items():
            assert torch.equal(biases[layer], bias), (rank, layer, biases[layer])
