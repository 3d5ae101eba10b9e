"""`python -m torchpre.convert`: torchpre checkpoints to Hugging Face Llama folders and back.

Logits are compared in fp32 with atol 1e-5: both models do the same arithmetic (same weights,
fp32 RMSNorm, RoPE angles from the same fp32 frequencies, SDPA) in a different order (grouped
heads repeated vs broadcast, rotate-half vs interleaved pairs), so only reduction-order noise
remains: at most 1e-6 measured, on logits up to ~5. The bound must stay well below the effect of
a RoPE mistake, which is small at init because attention is nearly uniform: leaving wq/wk
unpermuted, or dropping the RoPE scaling, moves the tiny model's logits by ~6e-4 (0.05 for
debugmodel_tied).
"""

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.launch import add_manifest, run_entry
from torchpre.checkpoint.integrity import MANIFEST, read_manifest, verify_share
from torchpre.config.job_config import JobConfig
from torchpre.config.parser import parse_args, to_toml
from torchpre.convert import main as convert_main
from torchpre.data.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer
from torchpre.errors import TorchpreError
from torchpre.models.llama3.args import LLAMA3_FLAVORS, RopeScaling
from torchpre.models.llama3.hf import (
    args_from_hf_config,
    from_hf_state_dict,
    hf_config,
    hf_config_mismatches,
    to_hf_state_dict,
)
from torchpre.models.llama3.model import Transformer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

REPO = Path(__file__).resolve().parents[2]
SEQ_LEN = 32
LOGITS_ATOL = 1e-5
VOCAB_SIZE = load_tokenizer(DEFAULT_TOKENIZER_PATH).vocab_size


def write_job(tmp_path: Path, flavor: str) -> tuple[JobConfig, Path]:
    config = parse_args(JobConfig, ["--model.flavor", flavor, "--training.seq_len", str(SEQ_LEN)])
    path = tmp_path / "job.toml"
    path.write_text(to_toml(config))
    return config, path


def build_model(args, seed: int = 0) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model.eval()


def flavor_args(flavor: str):
    """The args the trainer derives for `flavor` with the shipped tokenizer and SEQ_LEN."""
    return dataclasses.replace(LLAMA3_FLAVORS[flavor], vocab_size=VOCAB_SIZE, max_seq_len=SEQ_LEN)


def save_checkpoint(model: Transformer, config: JobConfig, step_dir: Path) -> None:
    """A step folder as the trainer writes it; the non-model entries must be ignored."""
    dcp.save({"model": model.state_dict(), "train": {"step": 5}}, checkpoint_id=step_dir, no_dist=True)
    (step_dir / "config.toml").write_text(to_toml(config))
    add_manifest(step_dir)


def load_checkpoint_model(step_dir: Path, like: Transformer) -> dict[str, torch.Tensor]:
    """The way trainers read "model": into full tensors shaped like the model's."""
    state_dict = {fqn: torch.empty_like(t) for fqn, t in like.state_dict().items()}
    dcp.load({"model": state_dict}, checkpoint_id=step_dir, no_dist=True)
    return state_dict


def convert(*args) -> subprocess.CompletedProcess:
    return run_entry("torchpre.convert", list(map(str, args)), timeout=120)


def convert_ok(*args) -> None:
    result = convert(*args)
    assert result.returncode == 0, result.stderr


def tokens(vocab_size: int, seq_len: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "flavor, options",
    [("tiny", ["--max_shard_size", "300KB"]), ("debugmodel_tied", [])],
    ids=["tiny-sharded", "tied"],
)
def test_dcp_to_hf_matches_transformers_and_round_trips_bitwise(flavor, options, tmp_path):
    transformers = pytest.importorskip("transformers")
    config, job = write_job(tmp_path, flavor)
    model = build_model(flavor_args(flavor))
    step_dir, hf_dir, back_dir = tmp_path / "ckpt" / "step-5", tmp_path / "hf", tmp_path / "back" / "step-0"
    save_checkpoint(model, config, step_dir)

    convert_ok("dcp-to-hf", step_dir, hf_dir, "--job.config_file", job, *options)
    index = hf_dir / "model.safetensors.index.json"
    files = ["model.safetensors"]
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    assert len(files) > 1 if options else files == ["model.safetensors"]
    names = {name for file in files for name in safe_open(hf_dir / file, "pt").keys()}
    assert ("lm_head.weight" in names) != model.args.tie_word_embeddings
    assert json.loads((hf_dir / "generation_config.json").read_text()) == {"bos_token_id": 2046, "eos_token_id": 2047}

    umask = os.umask(0)
    os.umask(umask)
    for path in hf_dir.iterdir():  # readable by others, like any file the user writes (not 0600)
        assert path.stat().st_mode & 0o777 == 0o666 & ~umask, path
    text = "def main():\n    return 'héllo' 12345"
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert hf_tokenizer(text)["input_ids"] == load_tokenizer(DEFAULT_TOKENIZER_PATH).encode(text, bos=True, eos=False)
    assert hf_tokenizer.decode(hf_tokenizer(text)["input_ids"], skip_special_tokens=True) == text

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    ids = tokens(model.args.vocab_size, SEQ_LEN)
    with torch.no_grad():
        torch.testing.assert_close(hf_model(ids).logits, model(ids), rtol=0, atol=LOGITS_ATOL)

    convert_ok("hf-to-dcp", hf_dir, back_dir, "--job.config_file", job)
    assert [p.name for p in back_dir.parent.iterdir()] == ["step-0"], "a temporary folder was left behind"
    # with the manifest a training save writes: every file's size and CRC, which loading checks
    assert set(read_manifest(back_dir)) == {path.name for path in back_dir.iterdir()} - {MANIFEST}
    assert verify_share(back_dir, rank=0, world_size=1) == []
    assert parse_args(JobConfig, ["--job.config_file", str(back_dir / "config.toml")]).model == config.model
    back = load_checkpoint_model(back_dir, like=model)
    for fqn, tensor in model.state_dict().items():
        assert torch.equal(back[fqn], tensor), fqn


def test_bfloat16_export_and_bad_paths(tmp_path):
    config, job = write_job(tmp_path, "tiny")
    model = build_model(flavor_args("tiny"))
    step_dir, hf_dir = tmp_path / "ckpt" / "step-1", tmp_path / "hf"
    save_checkpoint(model, config, step_dir)

    convert_main(["dcp-to-hf", str(step_dir), str(hf_dir), "--job.config_file", str(job), "--dtype", "bfloat16"])
    assert json.loads((hf_dir / "config.json").read_text())["torch_dtype"] == "bfloat16"
    expected = to_hf_state_dict(model.state_dict(), model.args)
    for name, tensor in load_file(hf_dir / "model.safetensors").items():
        assert torch.equal(tensor, expected[name].bfloat16()), name

    with pytest.raises(TorchpreError, match="already exists"):
        convert_main(["dcp-to-hf", str(step_dir), str(hf_dir), "--job.config_file", str(job)])
    missing = tmp_path / "no" / "step-3"
    with pytest.raises(TorchpreError, match=f"{missing} does not exist"):
        convert_main(["dcp-to-hf", str(missing), str(tmp_path / "out"), "--job.config_file", str(job)])
    with pytest.raises(TorchpreError, match=f"{missing} does not exist"):
        convert_main(["hf-to-dcp", str(missing), str(tmp_path / "out"), "--job.config_file", str(job)])
    with pytest.raises(TorchpreError, match="usage"):
        convert_main(["to-hf", str(step_dir), str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_mismatched_hf_config_exits_naming_the_field(tmp_path):
    _, job = write_job(tmp_path, "tiny")
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    right = hf_config(flavor_args("tiny"), bos_token_id=0, eos_token_id=1, torch_dtype="float32")
    wrong = right | {"num_hidden_layers": 3}
    (hf_dir / "config.json").write_text(json.dumps(wrong))

    result = convert("hf-to-dcp", hf_dir, tmp_path / "out" / "step-0", "--job.config_file", job)
    assert result.returncode != 0
    assert "num_hidden_layers = 3" in result.stderr and "n_layers = 2" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flavor", list(LLAMA3_FLAVORS))
def test_hf_config_maps_back_to_the_same_args(flavor):
    args = dataclasses.replace(LLAMA3_FLAVORS[flavor], vocab_size=128256)
    config = hf_config(args, bos_token_id=128000, eos_token_id=128001, torch_dtype="bfloat16")
    assert config["intermediate_size"] == args.ffn_hidden_dim
    assert hf_config_mismatches(config, args) == []
    assert args_from_hf_config(config).ffn_hidden_dim == args.ffn_hidden_dim
    if flavor == "8B":  # Meta-Llama-3.1-8B's config.json
        assert config["intermediate_size"] == 14336 and config["rope_scaling"] == {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    narrow = config | {"intermediate_size": args.dim}  # narrower than 8/3 dim, as some HF models are
    assert args_from_hf_config(narrow).ffn_hidden_dim == args.dim
    assert hf_config_mismatches(config | {"vocab_size": 1000}, args) == [
        "vocab_size = 1000 in the Hugging Face config, but the job's model has vocab_size = 128256"
    ]


def test_rope_scaling_matches_transformers_and_its_saved_config():
    """Llama 3.1 RoPE scaling, in-process on a tiny model: original_max_position_embeddings = 16 makes
    the scaling change most frequencies within 64 positions. Also reads back the config as the
    installed transformers writes it (5.x moves RoPE keys to `rope_parameters`)."""
    transformers = pytest.importorskip("transformers")
    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16)
    args = dataclasses.replace(LLAMA3_FLAVORS["tiny"], vocab_size=256, max_seq_len=64, rope_scaling=scaling)
    model = build_model(args)
    config = transformers.LlamaConfig(**hf_config(args, bos_token_id=0, eos_token_id=1, torch_dtype="float32"))
    assert hf_config_mismatches(config.to_dict(), args) == []
    hf_model = transformers.LlamaForCausalLM(config).eval()
    hf_model.load_state_dict(to_hf_state_dict(model.state_dict(), args), strict=True)
    ids = tokens(args.vocab_size, 64)
    with torch.no_grad():
        torch.testing.assert_close(hf_model(ids).logits, model(ids), rtol=0, atol=LOGITS_ATOL)


def test_state_dict_errors_name_the_tensors():
    args = dataclasses.replace(LLAMA3_FLAVORS["tiny"], vocab_size=256)
    hf_state_dict = to_hf_state_dict(build_model(args).state_dict(), args)
    del hf_state_dict["model.layers.1.mlp.up_proj.weight"]
    hf_state_dict["model.layers.1.mlp.bias"] = torch.zeros(1)
    hf_state_dict["model.norm.weight"] = torch.ones(3)
    with pytest.raises(TorchpreError) as error:
        from_hf_state_dict(hf_state_dict, args)
    assert "1 missing: model.layers.1.mlp.up_proj.weight" in str(error.value)
    assert "1 unknown: model.layers.1.mlp.bias" in str(error.value)
    assert "model.norm.weight (3,) (expected (64,))" in str(error.value)


def test_untied_output_does_not_pass_for_a_tied_model():
    untied = dataclasses.replace(LLAMA3_FLAVORS["tiny"], vocab_size=256)
    tied = dataclasses.replace(untied, tie_word_embeddings=True)
    state_dict = build_model(untied).state_dict()
    with pytest.raises(TorchpreError, match="output.weight differs from tok_embeddings.weight"):
        to_hf_state_dict(state_dict, tied)
    hf_state_dict = to_hf_state_dict(state_dict, untied)
    with pytest.raises(TorchpreError, match="lm_head.weight differs from model.embed_tokens.weight"):
        from_hf_state_dict(hf_state_dict, tied)


def test_deepseek_v3_dcp_to_hf_matches_transformers_and_round_trips_bitwise(tmp_path):
    """The deepseek_v3 family through the same commands: its debug model with nonzero routing biases (the balancing
    state a trained checkpoint holds) gives transformers' DeepseekV3ForCausalLM the same logits, and comes back to
    the bit; the same folder stored in block FP8 as released imports dequantized."""
    transformers = pytest.importorskip("transformers")
    from torchpre.models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS
    from torchpre.models.deepseek_v3.hf import to_hf_state_dict as to_deepseek_hf
    from torchpre.models.deepseek_v3.model import DeepSeekV3Transformer

    config = parse_args(JobConfig, ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel",
                                    "--training.seq_len", str(SEQ_LEN)])  # fmt: skip
    job = tmp_path / "job.toml"
    job.write_text(to_toml(config))
    args = dataclasses.replace(DEEPSEEK_V3_FLAVORS["debugmodel"], vocab_size=VOCAB_SIZE, max_seq_len=SEQ_LEN)
    model = DeepSeekV3Transformer(args).eval()
    model.init_weights(0)
    with torch.no_grad():
        for moe in model.moe_layers():
            moe.expert_bias.copy_(0.01 * torch.randn(args.num_experts, generator=torch.Generator().manual_seed(1)))
    step_dir, hf_dir, back_dir = tmp_path / "ckpt" / "step-5", tmp_path / "hf", tmp_path / "back" / "step-0"
    save_checkpoint(model, config, step_dir)

    convert_ok("dcp-to-hf", step_dir, hf_dir, "--job.config_file", job)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    assert type(hf_model).__name__ == "DeepseekV3ForCausalLM"
    ids = tokens(args.vocab_size, SEQ_LEN)
    with torch.no_grad():
        torch.testing.assert_close(hf_model(ids).logits, model(ids), rtol=0, atol=LOGITS_ATOL)

    convert_ok("hf-to-dcp", hf_dir, back_dir, "--job.config_file", job)
    back = load_checkpoint_model(back_dir, like=model)
    for fqn, tensor in model.state_dict().items():
        assert torch.equal(back[fqn], tensor), fqn

    # The released folders' block FP8 (here 16 x 16 blocks, so that weights hold several, some partial): hf-to-dcp
    # dequantizes each projection as its FP8 values times its blocks' scales, in bf16.
    fp8_dir, fp8_back = tmp_path / "hf-fp8", tmp_path / "back-fp8" / "step-0"
    fp8_dir.mkdir()
    original = load_file(hf_dir / "model.safetensors")
    weights, expected = dict(original), {}
    for name in [n for n in weights if n.endswith("_proj.weight") or n.endswith("kv_a_proj_with_mqa.weight")]:
        quantized, scale_inv = quantize_fp8_blocks(weights[name], 16)
        weights[name], weights[f"{name}_scale_inv"] = quantized, scale_inv
        expected[name] = (quantized.float() * scale_inv.repeat_interleave(16, 0).repeat_interleave(16, 1)[
            : quantized.shape[0], : quantized.shape[1]]).to(torch.bfloat16)  # fmt: skip
    save_file(weights, fp8_dir / "model.safetensors", metadata={"format": "pt"})
    hf_config = json.loads((hf_dir / "config.json").read_text())
    hf_config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [16, 16], "fmt": "e4m3"}
    (fp8_dir / "config.json").write_text(json.dumps(hf_config))
    convert_ok("hf-to-dcp", fp8_dir, fp8_back, "--job.config_file", job)
    dequantized = to_deepseek_hf(load_checkpoint_model(fp8_back, like=model), args)
    # Every projection: the dense block's 5 attention + 3 feed-forward, each MoE block's 5 + 8 experts x 3 + 3 shared.
    assert len(expected) == 8 + 2 * (5 + 8 * 3 + 3)
    for name, value in expected.items():
        assert torch.equal(dequantized[name].to(torch.bfloat16), value), name
        # e4m3 keeps 3 mantissa bits: each value within 1/16 of itself, bf16 adds 1/256: within 1/8 of the largest
        assert (value.float() - original[name]).abs().max() <= original[name].abs().max() / 8


def quantize_fp8_blocks(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn values and a float32 scale per block x block tile (the last ones partial), each tile's largest
    magnitude at e4m3's largest finite value (448), as the released DeepSeek-V3 weights are stored."""
    rows, cols = -(-weight.shape[0] // block), -(-weight.shape[1] // block)
    scale_inv = torch.empty(rows, cols)
    quantized = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            tile = weight[i * block : (i + 1) * block, j * block : (j + 1) * block].float()
            scale_inv[i, j] = tile.abs().max().clamp(min=1e-12) / 448
            quantized[i * block : (i + 1) * block, j * block : (j + 1) * block] = (tile / scale_inv[i, j]).to(
                torch.float8_e4m3fn
            )
    return quantized, scale_inv


def test_a_quantization_other_than_block_fp8_is_refused_by_name(tmp_path):
    from torchpre.interchange.reader import HFFolder

    save_file({"w.weight": torch.ones(2, 2)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gptq", "bits": 4}}))
    with pytest.raises(TorchpreError, match="quant_method 'gptq'.*Dequantize the weights first"):
        HFFolder(tmp_path)
    save_file({"w.weight_scale_inv": torch.ones(1, 1)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "fp8", "weight_block_size": [128, 128]}}))  # fmt: skip
    with pytest.raises(TorchpreError, match="w.weight_scale_inv has no weight w.weight"):
        HFFolder(tmp_path)
