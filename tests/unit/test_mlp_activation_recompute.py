"""activation_checkpoint.recompute_mlp_activation: each dense MLP keeps only its projections' outputs for backward
and recomputes its activation there (`torchpre.parallel.mlp_activation`). Gradients are bitwise those without it;
the planner's probe counts exactly two hidden-width tensors less per SwiGLU MLP, one per GELU MLP; where it cannot
run, preflight refuses it naming what to change. Under tp2 + SP + sequence_parallel_save_shard (whose saved-tensor
hooks wrap the same module) its losses are checked bitwise in tests/integration/test_bitwise_losses.py."""

import dataclasses
import gc
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from torchpre.config.job_config import JobConfig
from torchpre.config.parser import parse_args
from torchpre.errors import ConfigError
from torchpre.models.llama3.args import LLAMA3_FLAVORS
from torchpre.models.llama3.model import FeedForward, Transformer
from torchpre.models.llama3.parallelize import recompute_llama3_mlp_activations
from torchpre.parallel.mlp_activation import recompute_mlp_activation
from torchpre.planner.activation_probe import probe_microbatch
from torchpre.planner.stage_costs import microbatch_pieces
from torchpre.training import preflight

ARGS = dataclasses.replace(LLAMA3_FLAVORS["tiny"], vocab_size=128, max_seq_len=32)  # dim 64, 2 blocks
BATCH, SEQ = 2, 32
KEY = "--activation_checkpoint.recompute_mlp_activation"
# Hidden-width tensors an MLP keeps for backward that the key recomputes instead.
RECOMPUTED = {"swiglu": 2, "gelu": 1, "gelu_tanh": 1}


def _model(mlp: str, recompute: bool, device: str = "cpu") -> Transformer:
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(ARGS, mlp=mlp))
    if recompute:
        recompute_llama3_mlp_activations(model)
    if device != "meta":
        model.to_empty(device=device)
        model.init_weights(seed=0)
    return model


def _loss(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens.roll(-1, dims=1).flatten())


@contextmanager
def _no_garbage_collection() -> Iterator[None]:
    """A probe's counts without a collection at a moment of its choosing: what a reference cycle keeps alive counts."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.parametrize("mlp", list(RECOMPUTED))
def test_gradients_are_bitwise_those_without_the_key(mlp: str) -> None:
    tokens = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    grads = []
    for recompute in (False, True):
        model = _model(mlp, recompute)
        loss = _loss(model, tokens)
        loss.backward()
        grads.append((loss.detach(), {name: p.grad for name, p in model.named_parameters()}))
    (loss, expected), (loss_recomputing, measured) = grads
    assert torch.equal(loss, loss_recomputing)
    assert expected.keys() == measured.keys()
    for name, grad in expected.items():
        assert torch.equal(grad, measured[name]), f"{mlp}: gradient of {name} differs with the key"


def test_a_second_backward_through_a_retained_graph_rebuilds_the_activation_again() -> None:
    """The zero-bubble schedules run backward in two passes over a retained graph (input gradients, then weight
    gradients): the activation is rebuilt for the second pass, with the same values."""
    tokens = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    grads = []
    for recompute in (False, True):
        model = _model("swiglu", recompute)
        loss = _loss(model, tokens)
        loss.backward(retain_graph=True)
        loss.backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


@pytest.mark.parametrize("mlp", list(RECOMPUTED))
def test_the_probe_counts_the_recomputed_intermediates_less_per_mlp(mlp: str) -> None:
    tokens = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    saved = []
    for recompute in (False, True):
        model = _model(mlp, recompute, device="meta")
        with _no_garbage_collection():
            probe = probe_microbatch(model, (tokens,), loss_fn=lambda logits: logits.float().sum())
        saved.append(probe.saved_bytes)
    hidden_width_tensor = BATCH * SEQ * dataclasses.replace(ARGS, mlp=mlp).ffn_hidden_dim * 4  # fp32
    assert saved[0] - saved[1] == ARGS.n_layers * RECOMPUTED[mlp] * hidden_width_tensor, saved


def test_an_mlp_peaks_where_eager_autograd_does() -> None:
    """Backward computes the activation again while w2's backward runs: the MLP's peak stays eager autograd's (4
    bytes above: a scalar stands in for the recomputed output's values once w2 has used them)."""
    x = torch.empty(BATCH, SEQ, ARGS.dim, device="meta", requires_grad=True)
    peaks = []
    for recompute in (False, True):
        with torch.device("meta"):
            mlp = FeedForward(ARGS.dim, ARGS.ffn_hidden_dim)
        if recompute:
            recompute_mlp_activation(mlp)
        with _no_garbage_collection():
            probe = probe_microbatch(mlp, (x,))
        peaks.append(probe.saved_bytes + probe.transient_bytes)
    assert peaks[1] == peaks[0] + 4, peaks


def _config(tmp_path: Path, *keys: str) -> JobConfig:
    return parse_args(JobConfig, ["--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder",
                                  str(tmp_path), "--training.seq_len", "64", *keys])  # fmt: skip


def test_the_planner_prices_the_key_from_the_config_next_to_the_saved_shard(tmp_path: Path) -> None:
    """The planner's block probe, from the config as `python -m torchpre.plan` reads it, at tp2 + SP in bf16: saving
    the shard keeps half of each gathered input (attention's and the MLP's) less, and the key, in the same saved-tensor
    hooks around the MLP, two hidden-width tensors less on top."""
    tp2_sp = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_sequence_parallel",
              "--training.mixed_precision_param", "bfloat16"]  # fmt: skip
    keys = ([], ["--parallelism.sequence_parallel_save_shard"], ["--parallelism.sequence_parallel_save_shard", KEY])
    saved = [microbatch_pieces(_config(tmp_path, *tp2_sp, *extra), 1).block.saved_bytes for extra in keys]
    debug = LLAMA3_FLAVORS["debugmodel"]
    assert saved[0] - saved[1] == 2 * 64 * debug.dim * 2 // 2, saved  # two gathered inputs, half of each
    assert saved[1] - saved[2] == 2 * 64 * (debug.ffn_hidden_dim // 2) * 2, saved  # this rank's slice of the width


@pytest.mark.parametrize("family", ["llama3"])
def test_the_family_with_dense_mlps_accepts_the_key(tmp_path: Path, family: str) -> None:
    preflight.preflight(_config(tmp_path, "--model.name", family, KEY), 1)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (["--activation_checkpoint.mode", "full"], "with activation_checkpoint.mode = 'full': the checkpointed blocks"),
        (["--activation_checkpoint.mode", "selective"], "with activation_checkpoint.mode = 'selective'"),
        (["--compile.enable"], "which torch.compile cannot trace (a compiled block saves what its partitioner"),
        (["--model.name", "moe"], "model.name = 'moe' has no dense MLP whose activation it can recompute"),
        (["--model.name", "deepseek_v3"], "model.name = 'deepseek_v3' has no dense MLP whose activation"),
        (["--model.name", "hf", "--model.hf_config", "assets/hf_configs/qwen2_tiny.json"],
         "model.name = 'hf' has no dense MLP whose activation it can recompute"),
    ],
    ids=["full-ac", "selective-ac", "compile", "moe", "deepseek_v3", "hf"],
)  # fmt: skip
def test_where_it_cannot_run_it_is_refused_naming_the_key(tmp_path: Path, keys: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)) as error:
        preflight.preflight(_config(tmp_path, *keys, KEY), 1)
    assert "activation_checkpoint.recompute_mlp_activation" in str(error.value)


def test_the_model_without_the_key_is_unchanged_by_it() -> None:
    """The key wraps each MLP's activation in place: parameter names (and so checkpoints) are those without it."""
    plain, recomputing = _model("swiglu", False, "meta"), _model("swiglu", True, "meta")
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in recomputing.named_parameters()]
    assert recomputing.state_dict().keys() == plain.state_dict().keys()
