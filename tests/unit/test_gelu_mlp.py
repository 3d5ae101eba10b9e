"""model.mlp = "gelu" | "gelu_tanh": GPT's non-gated MLP, w2(gelu(w1 x)), 4 x dim wide, in the llama3 family's blocks;
against a hand-written GPT MLP, and refused, naming the key, where it cannot apply."""

import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tests.hf_folders import write_llama_folder
from tests.unit.test_model import ARGS, build, tokens
from torchpre.assembly.args import check_hf_mlp, model_args
from torchpre.config.job_config import JobConfig
from torchpre.config.parser import parse_args
from torchpre.data.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer
from torchpre.errors import ConfigError
from torchpre.models.llama3.args import LLAMA3_FLAVORS, TransformerArgs
from torchpre.models.llama3.model import Transformer
from torchpre.planner.activation_probe import probe_microbatch

TOKENIZER = load_tokenizer(DEFAULT_TOKENIZER_PATH)
GELU = dataclasses.replace(ARGS, mlp="gelu")


class ReferenceGptMlp(nn.Module):
    """GPT-2's MLP written out: c_proj(gelu(c_fc x)), GELU as x * Φ(x) through erf, or GPT-2's tanh formula."""

    def __init__(self, c_fc: Tensor, c_proj: Tensor, tanh: bool) -> None:
        super().__init__()
        self.c_fc, self.c_proj, self.tanh = nn.Parameter(c_fc.clone()), nn.Parameter(c_proj.clone()), tanh

    def forward(self, x: Tensor) -> Tensor:
        h = x @ self.c_fc.T
        if self.tanh:
            gelu = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))
        else:
            gelu = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))
        return gelu @ self.c_proj.T


def with_reference_mlps(model: Transformer, tanh: bool) -> Transformer:
    """A copy of `model` whose blocks' feed-forwards are `ReferenceGptMlp`s holding the same weights."""
    reference = Transformer(model.args)
    reference.load_state_dict(model.state_dict())
    for layer in reference.layers.values():
        layer.feed_forward = ReferenceGptMlp(layer.feed_forward.w1.weight, layer.feed_forward.w2.weight, tanh)
    return reference


def loss_and_grads(model: Transformer, mlp_names: tuple[str, str]) -> tuple[Tensor, dict[str, Tensor]]:
    """The next-token loss on fixed tokens and every parameter's gradient, the MLPs' named as `mlp_names` say."""
    batch = tokens()
    logits = model(batch[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    loss.backward()
    rename = dict(zip(mlp_names, ("w1.weight", "w2.weight")))
    grads = {}
    for name, parameter in model.named_parameters():
        prefix, found, last = name.rpartition(".feed_forward.")
        grads[f"{prefix}.feed_forward.{rename[last]}" if found else name] = parameter.grad
    return loss.detach(), grads


@pytest.mark.parametrize("mlp, tanh", [("gelu", False), ("gelu_tanh", True)])
def test_a_gelu_model_trains_as_one_with_hand_written_gpt_mlps(mlp: str, tanh: bool) -> None:
    """Loss and every gradient equal those of the same weights through GPT-2's MLP formula (fp32: 1e-6), while the
    other GELU (exact against tanh) moves the loss by more than that. The MLP weights are scaled up from the init's
    std 0.02, so that the pre-activations reach GELU's curve, not only its linear part near 0."""
    model = build(dataclasses.replace(ARGS, mlp=mlp))
    with torch.no_grad():
        for layer in model.layers.values():
            layer.feed_forward.w1.weight.mul_(50)
            layer.feed_forward.w2.weight.mul_(50)
    loss, grads = loss_and_grads(model, ("w1.weight", "w2.weight"))
    reference_loss, reference_grads = loss_and_grads(with_reference_mlps(model, tanh), ("c_fc", "c_proj"))
    assert loss.item() == pytest.approx(reference_loss.item(), abs=1e-6)
    assert grads.keys() == reference_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference_grads[name], atol=1e-6, rtol=1e-5, msg=name)
    other_loss, _ = loss_and_grads(with_reference_mlps(model, not tanh), ("c_fc", "c_proj"))
    assert abs(other_loss.item() - loss.item()) > 1e-6


def test_the_gelu_mlp_is_4_x_dim_wide_with_two_matrices() -> None:
    """GPT's width (4 x dim), ffn_dim_multiplier scaling it as for SwiGLU; no w3; the debug shapes' SwiGLU stays."""
    assert (GELU.ffn_hidden_dim, ARGS.ffn_hidden_dim) == (256, 256)  # SwiGLU: 2/3 of 256 rounded up to 256
    assert dataclasses.replace(GELU, dim=1024).ffn_hidden_dim == 4096
    assert dataclasses.replace(GELU, dim=1024, ffn_dim_multiplier=1.5).ffn_hidden_dim == 6144
    assert dataclasses.replace(ARGS, dim=1024).ffn_hidden_dim == 2816
    names = [name for name, _ in build(GELU).named_parameters() if name.startswith("layers.0.feed_forward")]
    assert names == ["layers.0.feed_forward.w1.weight", "layers.0.feed_forward.w2.weight"]


def test_mpt_7bs_shape_has_mpt_7bs_parameter_count() -> None:
    """d_model 4096, 32 layers, vocabulary 50,432, tied, no biases: 12 d^2 + 2 d a block (norm weights as MPT's
    bias-free LayerNorms), the embedding and the final norm: 6,649,286,656, MPT-7B's own count."""
    args = TransformerArgs(dim=4096, n_layers=32, n_heads=32, vocab_size=50432, tie_word_embeddings=True, mlp="gelu")
    with torch.device("meta"):
        model = Transformer(args)
    assert sum(p.numel() for p in model.parameters()) == 32 * (12 * 4096**2 + 2 * 4096) + 50432 * 4096 + 4096
    assert sum(p.numel() for p in model.parameters()) == 6_649_286_656


def test_the_gelu_mlp_takes_swiglus_init_for_w1_and_w2() -> None:
    """w1 at std 0.02, w2 shrinking with depth as a residual projection (layer 1: 0.02 / sqrt(4))."""
    model = build(dataclasses.replace(GELU, dim=256, n_heads=4, n_kv_heads=4))
    w1, w2 = model.layers["1"].feed_forward.w1.weight, model.layers["1"].feed_forward.w2.weight
    assert w1.std().item() == pytest.approx(0.02, rel=0.05)
    assert w2.std().item() == pytest.approx(0.01, rel=0.05)


def config_args(*argv: str, tokenizer=TOKENIZER):
    return model_args(parse_args(JobConfig, ["--model.flavor", "tiny", "--training.seq_len", "64", *argv]), tokenizer)


def test_model_mlp_sets_the_feed_forward_and_empty_keeps_the_flavors() -> None:
    assert config_args().mlp == "swiglu"
    assert config_args("--model.mlp", "gelu").mlp == "gelu"
    assert config_args("--model.mlp", "gelu_tanh", "--model.dim", "128").ffn_hidden_dim == 512
    # µP's base model has the same MLP: the hidden matrices' widths are the base's 4 x dim
    assert config_args("--model.mlp", "gelu", "--model.parametrization", "mup", "--model.mup_base_dim", "32").mlp == (
        "gelu"
    )


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["--model.name", "moe"], ["model.mlp = 'gelu'", "model.name = 'moe'", "SwiGLU", "Remove the key"]),
        (["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"], ["model.mlp = 'gelu'", "deepseek_v3"]),
        (["--model.name", "hf", "--model.hf_config", "assets/hf_configs/llama_tiny.json"],
         ["model.mlp = 'gelu'", "model.name = 'hf'", "hidden_act", "Remove the key"]),
        (["--hf_export.enable"], ["model.mlp = 'gelu'", "hf_export.enable = true", "model.mlp = 'swiglu'"]),
    ],
)  # fmt: skip
def test_refused_where_a_gelu_mlp_cannot_apply(argv: list[str], fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as error:
        config_args("--model.mlp", "gelu", *argv)
    assert all(fragment in str(error.value) for fragment in fragments), str(error.value)


def test_refused_with_a_hugging_face_llama_folder(tmp_path: Path) -> None:
    """Read as the flavor or as the initial weights, a Llama folder has a gated MLP."""
    args = dataclasses.replace(LLAMA3_FLAVORS["tiny"], vocab_size=TOKENIZER.vocab_size, max_seq_len=64)
    tmp_path = tmp_path / "llama"
    write_llama_folder(tmp_path, args)
    for argv, key in (
        (["--model.flavor", "from_hf"], "model.flavor = 'from_hf'"),
        ([], f"checkpoint.initial_load_path = '{tmp_path}' (a Hugging Face folder)"),
    ):
        with pytest.raises(ConfigError, match="Hugging Face Llama folder") as error:
            config_args("--model.mlp", "gelu", "--checkpoint.initial_load_path", str(tmp_path), *argv)
        assert f"model.mlp = 'gelu' with {key}" in str(error.value)


def test_conversion_to_a_hugging_face_llama_folder_is_refused() -> None:
    """`python -m torchpre.convert` checks the job's args with this before reading any weights."""
    check_hf_mlp(config_args(), "python -m torchpre.convert")
    with pytest.raises(ConfigError, match="model.mlp = 'gelu_tanh' with python -m torchpre.convert"):
        check_hf_mlp(config_args("--model.mlp", "gelu_tanh"), "python -m torchpre.convert")


def test_the_planners_probe_prices_the_two_intermediates_gelu_saves() -> None:
    """On the meta device, as the planner probes a model: SwiGLU's backward keeps four [tokens, hidden] tensors per
    block (w1's and w3's outputs, the SiLU, the product), GELU's two (w1's output, the GELU); the rest of the model is
    the same, so the saved bytes differ by exactly that (tiny: SwiGLU 192 wide, GELU 256; fp32)."""
    swiglu = dataclasses.replace(LLAMA3_FLAVORS["tiny"], max_seq_len=32)
    gelu = dataclasses.replace(swiglu, mlp="gelu")
    assert (swiglu.ffn_hidden_dim, gelu.ffn_hidden_dim) == (192, 256)
    batch, seq = 2, 32

    def saved(args: TransformerArgs) -> int:
        with torch.device("meta"):
            model = Transformer(args)
        tokens = torch.zeros(batch, seq, dtype=torch.long, device="meta")
        return probe_microbatch(model, (tokens,)).saved_bytes

    per_block = 4 * batch * seq * (4 * swiglu.ffn_hidden_dim - 2 * gelu.ffn_hidden_dim)
    assert saved(swiglu) - saved(gelu) == swiglu.n_layers * per_block
