"""The public parallelize API on someone else's model, unmodified: transformers' `LlamaForCausalLM`, sharded with
a tensor-parallel plan keyed by transformers' own module paths (tp2) and trained with ZeRO-1 over data parallelism
(dp2), reaches the losses and weights of the same model trained 3 steps with torch.optim.AdamW in one process; a
`Phi3ForCausalLM` with tied embeddings, given to the API with nothing said about the tie, stays tied at dp2."""

import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.launch import spawn
from torchpre.distributed.parallel_dims import ParallelDims
from torchpre.models.hf.model import init_weights
from torchpre.optim import build_optimizer
from torchpre.parallel import ParallelPlan, logits_of, parallelize

transformers = pytest.importorskip("transformers")

# The README's plan (examples/hf_parallelize.py), on transformers' own module paths; the embedding stays replicated.
from examples.hf_parallelize import TP_PLAN  # noqa: E402

pytestmark = pytest.mark.slow

CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
    use_cache=False,
)
SEED, STEPS, LR, WEIGHT_DECAY = 3, 3, 1e-2, 0.1
BATCH, SEQ_LEN = 4, 16
# fp32: only the order of reductions differs (TP partial sums, the DP gradient sum), ~1e-7.
ATOL = 1e-5
# Adam divides each gradient by its own magnitude, so where a gradient is nearly 0 reduction-order noise becomes a
# visible step (here up to ~1.2e-5 under tp2, ~3.5e-6 under dp2). A wrong or missing gradient
# term moves whole tensors by ~lr = 1e-2 per step.
PARAM_ATOL = 1e-4


def build_model():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ_LEN + 1), generator=generator) for _ in range(STEPS)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def scaled_cross_entropy(output, labels: torch.Tensor, scale: float) -> torch.Tensor:
    """`scale` times the mean token cross-entropy of what the model returned (a CausalLMOutputWithPast)."""
    logits = logits_of(output)
    return scale * F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def full_parameters(named) -> dict[str, torch.Tensor]:
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for name, p in named}


@pytest.fixture(scope="module")
def plain_pytorch() -> dict:
    """The reference: one process, plain AdamW with the param groups build_optimizer uses."""
    model = build_model()
    init_weights(model, SEED)
    initial = full_parameters(model.named_parameters())
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), eps=1e-8)
    losses = []
    for inputs, labels in batches():
        loss = scaled_cross_entropy(model(inputs), labels, 1.0)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "initial": initial, "weights": full_parameters(model.named_parameters())}


def train_with_the_api(layout: str, out: Path, mesh) -> None:
    """The model as transformers builds it, on the meta device; tp2: TP_PLAN; dp2: each rank trains on its half
    of every batch with ZeRO-1, its loss scaled by 1/dp so that the DP gradient sum is the global mean."""
    dp, tp = (1, 2) if layout == "tp2" else (2, 1)
    mesh = ParallelDims.from_degrees(dp=dp, tp=tp, pp=1, world_size=2).build_mesh("cpu")
    with torch.device("meta"):
        model = build_model()
    plan = ParallelPlan(tensor_parallel=TP_PLAN if tp > 1 else None)
    model = parallelize(
        model,
        mesh,
        plan,
        device=torch.device("cpu"),
        init_weights=lambda part: init_weights(part, SEED),
        loss_fn=functools.partial(scaled_cross_entropy, scale=1 / dp),
    )
    initial = full_parameters(model.named_parameters())
    optimizer = build_optimizer(model, zero_stage=1 if dp > 1 else 0, lr=LR, weight_decay=WEIGHT_DECAY, max_norm=0.0)
    dp_rank, dp_group = mesh["dp"].get_local_rank(), mesh["dp"].get_group()
    losses = []
    for inputs, labels in batches():
        mine = (inputs.chunk(dp)[dp_rank], labels.chunk(dp)[dp_rank])
        loss = model.forward_backward([mine])
        optimizer.step()
        dist.all_reduce(loss, group=dp_group)  # the global mean: the sum of the DP ranks' scaled shares
        losses.append(loss)
    result = {"losses": torch.stack(losses), "initial": initial, "weights": full_parameters(model.named_parameters())}
    torch.save(result, out / f"rank{dist.get_rank()}.pt")


@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_the_api_on_a_transformers_model_matches_plain_pytorch(layout, plain_pytorch, tmp_path):
    spawn(functools.partial(train_with_the_api, layout, tmp_path), 2, tmp_path / "store")
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert set(result["weights"]) == set(plain_pytorch["weights"])
        for name, value in result["initial"].items():  # the same start, bit for bit
            torch.testing.assert_close(value, plain_pytorch["initial"][name], rtol=0, atol=0, msg=name)
        torch.testing.assert_close(result["losses"], torch.tensor(plain_pytorch["losses"]), rtol=0, atol=ATOL)
        for name, value in result["weights"].items():
            torch.testing.assert_close(value, plain_pytorch["weights"][name], rtol=0, atol=PARAM_ATOL, msg=name)
    assert plain_pytorch["losses"][-1] < plain_pytorch["losses"][0]


PHI3_TIED = dict(CONFIG, tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=2)


def build_tied_phi3():
    return transformers.Phi3ForCausalLM(transformers.Phi3Config(**PHI3_TIED))


def train_tied_phi3_at_dp2(out: Path, mesh) -> None:
    """The plan says nothing about the tie: `parallelize` must find it on the meta model."""
    mesh = ParallelDims.from_degrees(dp=2, tp=1, pp=1, world_size=2).build_mesh("cpu")
    with torch.device("meta"):
        model = build_tied_phi3()
    model = parallelize(
        model,
        mesh,
        ParallelPlan(),
        device=torch.device("cpu"),
        init_weights=lambda part: init_weights(part, SEED),
        loss_fn=functools.partial(scaled_cross_entropy, scale=1 / 2),
    )
    optimizer = build_optimizer(model, zero_stage=1, lr=LR, weight_decay=WEIGHT_DECAY, max_norm=0.0)
    dp_rank, dp_group = mesh["dp"].get_local_rank(), mesh["dp"].get_group()
    losses = []
    for inputs, labels in batches():
        loss = model.forward_backward([(inputs.chunk(2)[dp_rank], labels.chunk(2)[dp_rank])])
        optimizer.step()
        dist.all_reduce(loss, group=dp_group)
        losses.append(loss)
    (part,) = model.parts
    result = {"losses": torch.stack(losses), "weights": full_parameters(part.named_parameters(remove_duplicate=False))}
    result["tied"] = part.lm_head.weight is part.model.embed_tokens.weight
    torch.save(result, out / f"rank{dist.get_rank()}.pt")


def test_the_api_keeps_a_transformers_models_tied_embeddings_tied_at_dp2(tmp_path):
    """Bitwise equal to plain transformers + torch.optim.AdamW in one process that accumulates the same two half
    batches (the DP sum of two ranks' gradients is then the same additions). Untied by `to_empty`, as before
    issue 50, the losses differed by 1.8e-2 from step 2 and lm_head.weight ended 5.7e-2 away."""
    model = build_tied_phi3()
    init_weights(model, SEED)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), eps=1e-8)
    losses = []
    for inputs, labels in batches():
        total = torch.zeros(())
        for half_inputs, half_labels in zip(inputs.chunk(2), labels.chunk(2)):
            loss = scaled_cross_entropy(model(half_inputs), half_labels, 1 / 2)
            loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    expected = full_parameters(model.named_parameters(remove_duplicate=False))

    spawn(functools.partial(train_tied_phi3_at_dp2, tmp_path), 2, tmp_path / "store")
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result["tied"]
        torch.testing.assert_close(result["losses"], torch.stack(losses), rtol=0, atol=0)
        assert set(result["weights"]) == set(expected)
        for name, value in result["weights"].items():
            torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)
    assert losses[-1] < losses[0]
