"""deepseek_v3's tensor-parallel plan (heads sharded, the latents' down-projections replicated) with sequence
parallelism on 2 gloo ranks: logits and every parameter's gradient equal one process's, with a query latent and
without one (the Lite models' single query projection, the plan's other branch); and at tp2 without SP, generation's
layout, decoding through the latent KV cache gives one process's logits without a cache."""

import dataclasses
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from tests.launch import spawn
from torchpre.models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS
from torchpre.models.deepseek_v3.model import DeepSeekV3Transformer
from torchpre.models.deepseek_v3.parallelize import apply_deepseek_v3_tensor_parallel

pytestmark = pytest.mark.slow

# fp32 on CPU: the ranks sum head shards and gather sequence slices, ~1e-7 relative (measured: logits within 2.4e-7
# of one process). A gradient that misses a rank's
# share is off by far more: without `SharedRopeKey`, wkv_a's by 5.4e-5 (of 5.4e-3) and the ranks' copies diverge.
ATOL = 1e-5


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
        for name, p in model.named_parameters()
    }


def _tp2_matches_one_process(q_lora_rank: int, mesh) -> None:
    flavor = DEEPSEEK_V3_FLAVORS["debugmodel"]
    args = dataclasses.replace(flavor, vocab_size=256, max_seq_len=16, q_lora_rank=q_lora_rank)
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    results = []
    for tp in (False, True):
        with torch.device("meta"):
            model = DeepSeekV3Transformer(args)
        if tp:
            apply_deepseek_v3_tensor_parallel(model, mesh, sequence_parallel=True, loss_parallel=False)
        model.to_empty(device="cpu")
        model.init_weights(0)
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        results.append((logits.detach(), _grads(model)))
    (reference, reference_grads), (logits, grads) = results
    assert isinstance(model.layers["1"].attention.wkv_b.weight, DTensor)
    assert not isinstance(model.layers["1"].attention.wkv_a.weight, DTensor)
    torch.testing.assert_close(logits, reference, rtol=0, atol=ATOL)
    assert grads.keys() == reference_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference_grads[name], rtol=0, atol=ATOL, msg=name)


@pytest.mark.parametrize("q_lora_rank", [32, 0], ids=["query-latent", "lite"])
def test_tp2_sp_matches_one_process(q_lora_rank: int, tmp_path: Path) -> None:
    spawn(partial(_tp2_matches_one_process, q_lora_rank), 2, tmp_path / "store")


def _tp2_latent_cache_decodes_as_one_process(q_lora_rank: int, mesh) -> None:
    """Generation's layout (tp2, no SP): each rank's heads read the whole latent cache through its shard of
    `wkv_b`; every step's logits equal one process's full forward without a cache."""
    flavor = DEEPSEEK_V3_FLAVORS["debugmodel"]
    args = dataclasses.replace(flavor, vocab_size=256, max_seq_len=16, q_lora_rank=q_lora_rank)
    tokens = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))
    models = []
    for tp in (False, True):
        with torch.device("meta"):
            model = DeepSeekV3Transformer(args)
        if tp:
            apply_deepseek_v3_tensor_parallel(model, mesh, sequence_parallel=False, loss_parallel=False)
        model.to_empty(device="cpu")
        model.init_weights(0)
        models.append(model.eval())
    reference, model = models
    model.setup_caches(2, 10)
    with torch.no_grad():
        steps = [model(tokens[:, :6], start_pos=0)] + [model(tokens[:, i : i + 1], start_pos=i) for i in range(6, 10)]
        # measured: 1.2e-6 (query latent), 9.5e-7 (lite)
        torch.testing.assert_close(torch.cat(steps, dim=1), reference(tokens), rtol=0, atol=ATOL)
    assert model.layers["1"].attention.kv_cache.latent.shape == (2, 10, args.kv_lora_rank)


@pytest.mark.parametrize("q_lora_rank", [32, 0], ids=["query-latent", "lite"])
def test_tp2_latent_cache_decodes_as_one_process(q_lora_rank: int, tmp_path: Path) -> None:
    spawn(partial(_tp2_latent_cache_decodes_as_one_process, q_lora_rank), 2, tmp_path / "store")
