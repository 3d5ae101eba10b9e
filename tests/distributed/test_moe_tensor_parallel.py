"""MoE under tensor parallelism, directly on the model: the routed experts and the shared expert are sharded
over tp (not replicated), and one forward/backward gives the loss and every parameter's gradient of the
same model in one process, with and without sequence parallel."""

import dataclasses
import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from tests.launch import spawn
from torchpre.models.moe.args import MOE_FLAVORS
from torchpre.models.moe.model import MoETransformer
from torchpre.models.moe.parallelize import apply_moe_tensor_parallel
from torchpre.parallel.tensor_parallel import reduce_partial_gradients

pytestmark = pytest.mark.slow

ARGS = dataclasses.replace(MOE_FLAVORS["tiny"], vocab_size=256)
SEED = 5
# fp32: only the order of the partial sums differs; a missing or doubled all-reduce is off by O(1).
ATOL = 1e-5


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, ARGS.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1], tokens[:, 1:]


def loss_and_gradients(model: MoETransformer) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    inputs, labels = batch()
    loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def run_under_tp(sequence_parallel: bool, out: Path, mesh) -> None:
    with torch.device("meta"):
        model = MoETransformer(ARGS)
    apply_moe_tensor_parallel(model, mesh, sequence_parallel=sequence_parallel, loss_parallel=False)
    model.to_empty(device="cpu")
    model.init_weights(SEED)
    loss, _ = loss_and_gradients(model)
    reduce_partial_gradients(model.parameters(), mesh.get_group())
    experts, shared = model.layers["0"].moe.experts, model.layers["0"].moe.shared_expert
    placements = {
        "experts.w1": (experts.w1.placements, experts.w1.to_local().shape),
        "experts.w2": (experts.w2.placements, experts.w2.to_local().shape),
        "shared.w1": (shared.w1.weight.placements, shared.w1.weight.to_local().shape),
    }
    grads = {
        name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
        for name, p in model.named_parameters()
    }
    torch.save({"loss": loss, "grads": grads, "placements": placements}, out / f"rank{dist.get_rank()}.pt")


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_moe_tensor_parallel_shards_the_experts_and_matches_one_process(sequence_parallel, tmp_path):
    spawn(functools.partial(run_under_tp, sequence_parallel, tmp_path), 2, tmp_path / "store")
    reference = MoETransformer(ARGS)
    reference.init_weights(SEED)
    loss, grads = loss_and_gradients(reference)
    E, dim, hidden = ARGS.num_experts, ARGS.dim, ARGS.moe_hidden_dim
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result["placements"] == {
            "experts.w1": ((Shard(2),), (E, dim, hidden // 2)),
            "experts.w2": ((Shard(1),), (E, hidden // 2, dim)),
            "shared.w1": ((Shard(0),), (ARGS.shared_expert_hidden_dim // 2, dim)),
        }
        torch.testing.assert_close(result["loss"], loss, rtol=0, atol=ATOL)
        assert result["grads"].keys() == grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(result["grads"][name], grad, rtol=0, atol=ATOL, msg=name)
