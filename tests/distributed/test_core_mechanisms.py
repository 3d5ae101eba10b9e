"""The core multi-rank mechanisms on two gloo ranks, each against what one process computes, in one spawn (fast
enough for scripts/mutation_check.py): the DP gradient reduction and ZeRO-1 and 2 (uneven shards, stage 2's sum
over microbatches, the all-gather of the
updated parameters, the global gradient norm), the gradient sum of a weight tied across pipeline stages, a pp2
schedule's gradients over several microbatches, the expert-parallel all-to-all with uneven token counts, and the
non-finite verdict every rank must share."""

import copy
import functools
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tests.gpt2_model import GPT2, GPT2Args
from tests.launch import spawn
from tests.optimizers import entries, plain_optimizer
from torchpre.distributed.parallel_dims import ParallelDims
from torchpre.health.verdict import step_verdict
from torchpre.models.moe.model import GroupedExperts
from torchpre.optim import build_optimizer
from torchpre.parallel import ParallelPlan, PipelinePlan, parallelize, pipeline_stages
from torchpre.parallel.expert_parallel import apply_expert_parallel
from torchpre.parallel.pipeline import sync_tied_gradients

pytestmark = pytest.mark.slow

STEPS = 3
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}
WEIGHT_DECAY = 0.1
MAX_NORM = 0.05  # below every step's norm (0.2-0.4), so clipping scales each step
# fp32 on CPU: two ranks change only the order of the sums. Measured after 3 steps: parameters at most 3.0e-8
# apart, norms 7.2e-8 relative; the tolerances are 5 times that.
ATOL, NORM_RTOL = 1.5e-7, 4e-7
INPUTS = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
TARGETS = torch.randn(8, 3, generator=torch.Generator().manual_seed(2))


def _model() -> nn.Module:
    """Row counts 5 and 3 split unevenly over two ZeRO-1 ranks."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A share of the global mean: divided by the global element count, so the shares sum to the mean."""
    return (model(inputs) - targets).square().sum() / TARGETS.numel()


def _one_process() -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Norms before clipping and final parameters of plain AdamW on the whole batch, with global clipping."""
    model = _model()
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": matrices, "weight_decay": WEIGHT_DECAY}, {"params": vectors, "weight_decay": 0.0}]
    adamw = torch.optim.AdamW(groups, **ADAMW)
    norms = []
    for _ in range(STEPS):
        _loss(model, INPUTS, TARGETS).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        adamw.step()
        adamw.zero_grad()
    return norms, {name: p.detach() for name, p in model.named_parameters()}


def _check_data_parallel(zero_stage: int, mesh: DeviceMesh, microbatches: int = 1) -> None:
    """`microbatches` > 1 announces each backward as `forward_backward` does, so stage 2 reduce-scatters each
    microbatch's gradients into its shard while the next runs."""
    norms, expected = _one_process()
    model = _model()
    optimizer = plain_optimizer(
        list(model.named_parameters()), zero_stage=zero_stage, state_mesh=mesh, dp_group=mesh["dp"].get_group(),
        tp_group=mesh["tp"].get_group(), pp_group=mesh["tp"].get_group(), accumulate_in_fp32=True,
        weight_decay=WEIGHT_DECAY, max_norm=MAX_NORM, build_inner=functools.partial(torch.optim.AdamW, **ADAMW),
    )
    rank = dist.get_rank()
    for step in range(STEPS):
        batches = zip(INPUTS.chunk(2)[rank].chunk(microbatches), TARGETS.chunk(2)[rank].chunk(microbatches))
        for i, (inputs, targets) in enumerate(batches):
            loss = _loss(model, inputs, targets)
            if microbatches > 1:
                optimizer.reduction.buckets.on_backward(0, last=i == microbatches - 1)
            loss.backward()
        norm = optimizer.step()
        what = f"zero {zero_stage}: step {step} norm"
        torch.testing.assert_close(norm, norms[step], rtol=NORM_RTOL, atol=0, msg=what)
    for name, param in model.named_parameters():
        what = f"zero {zero_stage}: {name}"
        torch.testing.assert_close(param.detach(), expected[name], rtol=0, atol=ATOL, msg=what)


def _check_tied_gradient_sum() -> None:
    """Rank 0 holds the embedding, rank 1 the output layer: both end with the sum of the two gradients."""
    rank = dist.get_rank()
    tied = ("tok_embeddings.weight", "output.weight")
    grads = {tied[rank]: torch.full((2, 3), float(rank + 1))}
    sync_tied_gradients(grads, tied, peer_rank=1 - rank, group=dist.group.WORLD)
    assert torch.equal(grads[tied[rank]], torch.full((2, 3), 3.0)), grads


MICROBATCHES = 4
TIED = ("wte.weight", "lm_head.weight")


def _microbatch_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A microbatch's share of the batch mean: the schedule must not scale it again."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten()) / MICROBATCHES


def _check_pipeline_gradients() -> None:
    """A GPT-2 at pp2 under 1F1B with 4 microbatches: every gradient a stage holds (the tied weight's copies
    aside, summed later) equals the one-process gradient of the batch mean loss."""
    args = GPT2Args(vocab_size=64)
    tokens = torch.randint(0, args.vocab_size, (MICROBATCHES, 9), generator=torch.Generator().manual_seed(0))
    reference = GPT2(args)
    reference.init_weights(3)
    F.cross_entropy(reference(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    expected = {name: p.grad for name, p in reference.named_parameters()}

    mesh = ParallelDims.from_degrees(dp=1, tp=1, pp=2, world_size=2).build_mesh("cpu")
    with torch.device("meta"):
        model = GPT2(args)
    pipeline = PipelinePlan.build(pipeline_stages(model, 2, blocks="h"), pp=2, schedule="1F1B",
                                  n_microbatches=MICROBATCHES)
    plan = ParallelPlan(pipeline=pipeline, blocks="h", tied_weights=TIED)
    model = parallelize(model, mesh, plan, device=torch.device("cpu"), init_weights=lambda m: m.init_weights(3),
                        loss_fn=_microbatch_loss)
    optimizer = build_optimizer(model)
    model.forward_backward([(tokens[:, :-1], tokens[:, 1:])])
    grads = {e.name: g for e, g in zip(entries(optimizer), optimizer.reduction.local_gradients()) if e.name not in TIED}
    assert grads, "this stage holds no untied parameter"
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)


def _check_expert_parallel(mesh: DeviceMesh) -> None:
    """Each rank sends a different number of tokens to each of 4 experts (2 per rank); outputs and the
    experts' gradients equal the unsharded module's on the same tokens."""
    rank = dist.get_rank()
    torch.manual_seed(3)
    experts = GroupedExperts(num_experts=4, dim=6, hidden_dim=8)
    reference = copy.deepcopy(experts)
    counts = torch.tensor([[3, 1, 0, 2], [1, 2, 4, 1]][rank])
    tokens = torch.randn(int(counts.sum()), 6, generator=torch.Generator().manual_seed(10 + rank))
    expected = reference(tokens, counts)
    apply_expert_parallel(experts, mesh)
    output = experts(tokens, counts)
    torch.testing.assert_close(output, expected, rtol=1e-6, atol=1e-6)


def _check_nonfinite_verdict_is_global() -> None:
    """Every rank gets the same verdict, on the host and as the device flag a conditional update skips on."""
    rank = dist.get_rank()
    bad_loss_on_rank1 = step_verdict(torch.tensor(math.nan if rank == 1 else 1.0), torch.tensor(1.0), tp_degree=1)
    health = bad_loss_on_rank1.read()
    assert not health.finite and not health.loss_finite and bad_loss_on_rank1.skip.item() == 1.0, (rank, health)
    bad_norm_on_rank0 = step_verdict(torch.tensor(1.0), torch.tensor(math.inf if rank == 0 else 1.0), tp_degree=1)
    health = bad_norm_on_rank0.read()
    assert not health.finite and not health.grad_norm_finite and bad_norm_on_rank0.skip.item() == 1.0, (rank, health)
    finite = step_verdict(torch.tensor(float(rank + 1)), torch.tensor(1.0), tp_degree=1)
    assert finite.read().finite and finite.read().loss == 3.0 and finite.skip.item() == 0.0, (rank, finite.read())


def _check_all(mesh: DeviceMesh) -> None:
    dp_tp = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    for zero_stage in (0, 1):
        _check_data_parallel(zero_stage, dp_tp)
    _check_data_parallel(2, dp_tp, microbatches=2)
    _check_tied_gradient_sum()
    _check_pipeline_gradients()
    _check_expert_parallel(mesh)
    _check_nonfinite_verdict_is_global()


def test_core_mechanisms_on_two_ranks_match_one_process(tmp_path):
    spawn(_check_all, world_size=2, store_path=tmp_path / "store")
