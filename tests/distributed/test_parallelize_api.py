"""The public parallelize API used directly, as docs/models.md shows it, against plain PyTorch: a GPT-2-style
model (defined in tests/integration/test_custom_model.py) trained 3 steps under tp2 and under pp2 reaches
the losses and weights of the same model trained with torch.optim.AdamW in one process."""

import functools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.gpt2_model import GPT2, TP_PLAN, GPT2Args
from tests.launch import spawn
from torchpre.distributed.parallel_dims import ParallelDims
from torchpre.optim import build_optimizer
from torchpre.parallel import ParallelPlan, PipelinePlan, parallelize, pipeline_stages

pytestmark = pytest.mark.slow

ARGS = GPT2Args(vocab_size=256)
SEED, STEPS, LR, WEIGHT_DECAY = 3, 3, 1e-2, 0.1
# fp32: only the order of reductions differs (TP partial sums, the pipeline's microbatch sum), ~1e-7.
ATOL = 1e-5
# Adam divides each gradient by its own magnitude: where a gradient is nearly 0 (the key bias, which softmax
# ignores, or a unit GELU barely opens) reduction-order noise becomes a visible step, here up to ~3e-5. A wrong
# or missing gradient term moves whole tensors by ~lr = 1e-2 per step.
PARAM_ATOL = 1e-4


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, ARGS.vocab_size, (4, 17), generator=generator) for _ in range(STEPS)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def mean_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def scaled_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, scale: float) -> torch.Tensor:
    return scale * mean_cross_entropy(logits, labels)


def train_with_plain_pytorch() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = GPT2(ARGS)
    model.init_weights(SEED)
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), eps=1e-8)
    losses = []
    for inputs, labels in batches():
        loss = mean_cross_entropy(model(inputs), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def train_with_the_api(layout: str, out: Path, mesh) -> None:
    """docs/models.md's snippet: meta model, plan, parallelize, build_optimizer, forward_backward, step."""
    tp, pp = (2, 1) if layout == "tp2" else (1, 2)
    mesh = ParallelDims.from_degrees(dp=1, tp=tp, pp=pp, world_size=2).build_mesh("cpu")
    with torch.device("meta"):
        model = GPT2(ARGS)
    pipeline = None
    if layout == "pp2":
        pipeline = PipelinePlan.build(pipeline_stages(model, 2, blocks="h"), pp=2, schedule="GPipe", n_microbatches=2)
    plan = ParallelPlan(
        tensor_parallel=TP_PLAN, pipeline=pipeline, blocks="h", tied_weights=("wte.weight", "lm_head.weight")
    )
    # The pipeline sums its microbatches' losses: each is half of the batch mean.
    loss_fn = functools.partial(scaled_cross_entropy, scale=1 / pipeline.n_microbatches if pipeline else 1.0)
    model = parallelize(
        model, mesh, plan, device=torch.device("cpu"), init_weights=lambda m: m.init_weights(SEED), loss_fn=loss_fn
    )
    optimizer = build_optimizer(model, lr=LR, weight_decay=WEIGHT_DECAY, max_norm=0.0)
    losses = []
    for batch in batches():
        losses.append(model.forward_backward([batch]))
        optimizer.step()
    weights = {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in model.named_parameters()
    }
    torch.save({"losses": torch.stack(losses), "weights": weights}, out / f"rank{torch.distributed.get_rank()}.pt")


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_the_api_matches_plain_pytorch(layout, tmp_path):
    spawn(functools.partial(train_with_the_api, layout, tmp_path), 2, tmp_path / "store")
    losses, weights = train_with_plain_pytorch()
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    last_stage = results[-1]  # under pp the last stage holds the loss; under tp every rank does
    torch.testing.assert_close(last_stage["losses"], torch.tensor(losses), rtol=0, atol=ATOL)
    seen = set()
    for result in results:
        for name, value in result["weights"].items():
            # Under pp the last stage's tied copy is its own Parameter, kept equal to the embedding.
            expected = weights["wte.weight"] if name == "lm_head.weight" else weights[name]
            torch.testing.assert_close(value, expected, rtol=0, atol=PARAM_ATOL, msg=name)
            seen.add(name)
    assert seen >= set(weights)
    assert losses[-1] < losses[0]
