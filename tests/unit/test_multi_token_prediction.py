"""DeepSeek-V3's multi-token prediction on one process, against the paper's loss written out plainly: depth k
joins the previous depth's hidden states with the embedding of the token k ahead, runs its block, and its
cross-entropy against the token k + 1 ahead (over the positions whose target is in the row) enters the training loss
weighted mtp_loss_weight / D and divided by the global token count."""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from torchpre.errors import ConfigError, TorchpreError
from torchpre.models.attention import DocumentMask, document_mask
from torchpre.models.deepseek_v3 import hf
from torchpre.models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS
from torchpre.models.deepseek_v3.model import DeepSeekV3Transformer
from torchpre.models.deepseek_v3.mtp import mtp_stats
from torchpre.models.deepseek_v3.spec import SPEC
from torchpre.parallel.forward_inputs import IGNORE_INDEX, future_tokens

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV3ForCausalLM  # noqa: E402

BATCH, SEQ, DEPTH, WEIGHT = 2, 16, 2, 0.3
ARGS = dataclasses.replace(
    DEEPSEEK_V3_FLAVORS["debugmodel"], vocab_size=256, max_seq_len=SEQ, mtp_depth=DEPTH, mtp_loss_weight=WEIGHT
)
# fp32 on CPU: the same operations in another order (the MTP loss's gradient added at the main hidden states rather
# than summed into one loss) measured 7.5e-9 on the parameters' gradients.
GRAD_TOLERANCE = 1e-6


def model_and_tokens(logit_multiplier: float = 1.0) -> tuple[DeepSeekV3Transformer, torch.Tensor]:
    """The debug model; a `logit_multiplier` (µP's, here alone) scales the main and every depth's logits."""
    parametrization = dataclasses.replace(ARGS.parametrization, logit_multiplier=logit_multiplier)
    model = DeepSeekV3Transformer(dataclasses.replace(ARGS, parametrization=parametrization))
    model.init_weights(seed=0)
    model.set_aux_loss_scale(1 / BATCH)
    model.set_token_loss_scale(1 / (BATCH * SEQ))
    tokens = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return model, tokens


def reference_loss(
    model: DeepSeekV3Transformer, tokens: torch.Tensor, labels: torch.Tensor, doc_mask: DocumentMask | None = None
) -> tuple[torch.Tensor, list[float]]:
    """The language-model loss plus the MTP losses, each depth sliced to the positions with a target in the row."""
    h = model.blocks(tokens, None, doc_mask)
    total = F.cross_entropy(model.head(h).flatten(0, 1), labels.flatten(), reduction="sum")
    depth_means = []
    for k in range(1, DEPTH + 1):
        depth = model.mtp.depths[str(k)]
        # t(i+k); past the row's end token 0, whose outputs are sliced off below (the routing statistics of the aux
        # loss still see them, so the filler must be the model's).
        ahead = torch.cat((tokens[:, k:], torch.zeros_like(tokens[:, :k])), dim=1)
        joined = torch.cat((depth.hidden_norm(h), depth.embedding_norm(model.tok_embeddings(ahead))), dim=-1)
        h = depth.block(depth.projection(joined), model.rope_cache, doc_mask=doc_mask)
        valid = SEQ - k - 1
        logits_k = model.logits(depth.norm(h))[:, :valid]
        loss_k = F.cross_entropy(logits_k.flatten(0, 1), tokens[:, k + 1 :].flatten(), reduction="sum")
        depth_means.append(loss_k.item() / (BATCH * valid))
        total = total + WEIGHT / DEPTH * loss_k
    return total / (BATCH * SEQ), depth_means


def test_future_tokens_are_the_tokens_ahead_and_ignored_past_the_row():
    rows = torch.arange(10, 16).view(1, 6)
    ahead = future_tokens(rows, 3)
    assert ahead[0, 0].tolist() == [11, 12, 13]
    assert ahead[0, 3].tolist() == [14, 15, IGNORE_INDEX]
    assert ahead[0, 5].tolist() == [IGNORE_INDEX] * 3


# Packed documents: every block, the depths' too, attends within its document (a new one at positions 5 and 11).
DOCUMENTS = torch.tensor([0] * 5 + [1] * 6 + [2] * 5).expand(BATCH, SEQ)


@pytest.mark.parametrize(
    ("documents", "logit_multiplier"),
    [(None, 1.0), (DOCUMENTS, 1.0), (None, 0.5)],
    ids=["causal", "document-mask", "logit-multiplier"],
)
def test_gradients_equal_the_written_out_loss_and_depth_losses_are_logged(world, documents, logit_multiplier):
    model, tokens = model_and_tokens(logit_multiplier)
    labels = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    logits = model(tokens, document_ids=documents, future_tokens=future_tokens(tokens, DEPTH + 1))
    (F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / (BATCH * SEQ)).backward()
    grads = {name: torch.zeros_like(p) if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}
    counts = model.mtp.target_counts.tolist()
    logged = mtp_stats([model], DEPTH, torch.device("cpu"))

    model.zero_grad()
    doc_mask = None if documents is None else document_mask(documents)
    expected, depth_means = reference_loss(model, tokens, labels, doc_mask)
    expected.backward()
    for name, p in model.named_parameters():
        assert torch.allclose(grads[name], p.grad, atol=GRAD_TOLERANCE, rtol=0), name
    assert all(grads[name].abs().sum() > 0 for name, _ in model.named_parameters() if ".projection." in name)
    assert counts == [BATCH * (SEQ - k - 1) for k in range(1, DEPTH + 1)]
    assert [logged["loss/mtp_1"], logged["loss/mtp_2"]] == pytest.approx(depth_means, rel=1e-6)
    assert model.mtp.target_counts.sum() == 0  # read and reset


def test_without_future_tokens_or_gradients_the_model_is_the_main_model():
    model, tokens = model_and_tokens()
    plain = model(tokens)
    with torch.no_grad():
        no_grad = model(tokens, future_tokens=future_tokens(tokens, DEPTH + 1))
    assert torch.equal(plain, model(tokens, future_tokens=future_tokens(tokens, DEPTH + 1)))
    assert torch.equal(plain.detach(), no_grad)
    assert model.mtp.target_counts.tolist() == [BATCH * (SEQ - k - 1) for k in range(1, DEPTH + 1)]


def test_the_embedding_copy_is_the_embedding_and_the_spec_ties_and_counts_it():
    model, _ = model_and_tokens()
    assert model.mtp_embeddings.weight is model.tok_embeddings.weight
    assert SPEC.build.tied_weights(ARGS) == ("tok_embeddings.weight", "mtp_embeddings.weight")
    assert SPEC.hooks.tokens_ahead(ARGS) == DEPTH + 1
    assert SPEC.hooks.tokens_ahead(DEEPSEEK_V3_FLAVORS["debugmodel"]) == 0
    # Each depth is a block of the last layer's kind (MoE), routed as the layers after the main ones.
    assert [row for row, _ in model.moe_layers_by_id()] == [1, 2, 3, 4]
    assert ARGS.router_rows == ARGS.n_layers + DEPTH


def test_mtp_with_tied_embeddings_is_refused():
    with pytest.raises(ConfigError, match="mtp_depth"):
        dataclasses.replace(ARGS, tie_word_embeddings=True)


def test_hugging_face_round_trip_puts_the_depths_after_the_layers_as_released(tmp_path):
    """Exported as DeepSeek-V3's released folders hold multi-token prediction (layer n_layers + k - 1, with copies of
    the embedding and output layer), imported back bitwise; transformers loads the folder, ignores those layers and
    computes the main model's logits; a job without multi-token prediction drops them on import."""
    model, tokens = model_and_tokens()
    exported = hf.to_hf_state_dict(model.state_dict(), ARGS)
    n = ARGS.n_layers
    for name in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "embed_tokens", "shared_head.head"):
        assert f"model.layers.{n}.{name}.weight" in exported and f"model.layers.{n + 1}.{name}.weight" in exported
    assert f"model.layers.{n + 1}.mlp.experts.7.down_proj.weight" in exported
    assert torch.equal(exported[f"model.layers.{n}.shared_head.head.weight"], exported["lm_head.weight"])
    imported = hf.from_hf_state_dict(exported, ARGS)
    assert imported.keys() == model.state_dict().keys()
    assert all(torch.equal(imported[name], value) for name, value in model.state_dict().items())

    config = hf.hf_config(ARGS, bos_token_id=0, eos_token_id=1, torch_dtype="float32")
    assert config["num_nextn_predict_layers"] == DEPTH
    save_file(exported, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    reference = DeepseekV3ForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        assert (reference(tokens).logits - model(tokens)).abs().max() <= 1e-5  # measured 2.4e-7

    without = dataclasses.replace(ARGS, mtp_depth=0)
    assert hf.from_hf_state_dict(exported, without).keys() == DeepSeekV3Transformer(without).state_dict().keys()
    exported[f"model.layers.{n}.embed_tokens.weight"] = exported[f"model.layers.{n}.embed_tokens.weight"] + 1
    with pytest.raises(TorchpreError, match="embed_tokens"):
        hf.from_hf_state_dict(exported, ARGS)


def test_671B_with_one_depth_adds_the_released_module():
    """The released module's own weights: its block, norms and projection (its embedding and output layer are
    the model's, stored as copies in a released folder)."""
    args = dataclasses.replace(DEEPSEEK_V3_FLAVORS["671B"], mtp_depth=1)
    with torch.device("meta"):
        model = DeepSeekV3Transformer(args)
    assert sum(p.numel() for p in model.parameters()) == 682_636_472_320
    assert sum(p.numel() for p in model.mtp.parameters()) == 11_610_067_968
