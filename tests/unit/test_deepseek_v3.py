"""The deepseek_v3 family against transformers' DeepseekV3 (the reference for every number): multi-head latent
attention alone, whole-model logits after importing a Hugging Face folder and after exporting back, the released
671B shape's parameter count, generation with the latent KV cache (against decoding without a cache) and the
cache's size, and its bad shapes refused."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from torchpre.config.job_config import JobConfig, Model
from torchpre.config.parser import parse_args
from torchpre.errors import ConfigError, TorchpreError
from torchpre.generate import generate_ids, whole_model
from torchpre.models.deepseek_v3 import hf
from torchpre.models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS, YarnScaling
from torchpre.models.deepseek_v3.model import (
    DeepSeekV3Transformer,
    LatentKVCache,
    MultiHeadLatentAttention,
    mla_rope_cache,
)
from torchpre.models.llama3.model import KVCache
from torchpre.models.llama3.rope_keys import with_rope
from torchpre.models.registry import get_flavor, get_model_spec

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402

# fp32 on CPU: the two implementations differ in operation order only (q scaled before the kernel rather than the
# scores after, the top-k outputs summed per token rather than scattered per expert): ~1e-7 relative.
TOLERANCE = 1e-5
SEQ = 24

# A tiny random config with every released feature: a query latent (or none, as in the Lite models), YaRN with
# mscale, group-limited sigmoid routing with a nonzero correction bias, a shared expert, a dense first block.
TINY = dict(
    vocab_size=96, hidden_size=48, intermediate_size=80, moe_intermediate_size=16, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2,
    n_group=4, topk_group=2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
    v_head_dim=12, qk_nope_head_dim=16, max_position_embeddings=64, initializer_range=0.1,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                     "mscale": 1.0, "mscale_all_dim": 0.7, "beta_fast": 32, "beta_slow": 1},
)  # fmt: skip


def hf_model(**overrides) -> DeepseekV3ForCausalLM:
    torch.manual_seed(0)
    config = DeepseekV3Config(**{**TINY, **overrides}, attn_implementation="eager")
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():  # released checkpoints carry nonzero balancing biases and non-unit norms
        for name, tensor in model.state_dict().items():
            if name.endswith(("e_score_correction_bias", "norm.weight", "layernorm.weight")):
                tensor.copy_(1 + 0.1 * torch.randn_like(tensor) if "norm" in name else 0.1 * torch.randn_like(tensor))
    return model


def imported(folder: Path) -> DeepSeekV3Transformer:
    args = hf.args_from_hf_config(json.loads((folder / "config.json").read_text()))
    model = DeepSeekV3Transformer(args).eval()
    model.load_state_dict(hf.from_hf_state_dict(load_file(folder / "model.safetensors"), args), strict=True)
    return model


@pytest.mark.parametrize("q_lora_rank", [24, None], ids=["query-latent", "lite"])
def test_logits_equal_transformers_after_import_and_after_export(q_lora_rank, tmp_path):
    reference = hf_model(q_lora_rank=q_lora_rank)
    reference.save_pretrained(tmp_path / "hf")
    ours = imported(tmp_path / "hf")
    tokens = torch.randint(0, TINY["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(tokens).logits
        logits = ours(tokens)
    # measured: 2.5e-6 (query latent), 1.7e-6 (lite), on logits up to 2.8
    assert (logits - expected).abs().max() <= TOLERANCE

    out = tmp_path / "exported"
    out.mkdir()
    save_file(hf.to_hf_state_dict(ours.state_dict(), ours.args), out / "model.safetensors", metadata={"format": "pt"})
    config = hf.hf_config(ours.args, bos_token_id=0, eos_token_id=1, torch_dtype="float32")
    (out / "config.json").write_text(json.dumps(config))
    assert hf.hf_config_mismatches(config, ours.args) == []
    reloaded = DeepseekV3ForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    with torch.no_grad():
        assert (reloaded(tokens).logits - logits).abs().max() <= TOLERANCE


def test_mla_alone_equals_transformers_attention():
    reference = hf_model()
    hf_attention = reference.model.layers[1].self_attn
    ours = imported_from_memory(reference)
    x = torch.randn(2, SEQ, TINY["hidden_size"], generator=torch.Generator().manual_seed(2))
    positions = torch.arange(SEQ)[None]
    causal = torch.full((SEQ, SEQ), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        expected, _ = hf_attention(x, reference.model.rotary_emb(x, positions), attention_mask=causal)
        out = ours.layers["1"].attention(x, ours.rope_cache)
    assert (out - expected).abs().max() <= TOLERANCE  # measured: 6.0e-8, outputs up to 0.68


def imported_from_memory(reference: DeepseekV3ForCausalLM) -> DeepSeekV3Transformer:
    args = hf.args_from_hf_config(reference.config.to_dict())
    model = DeepSeekV3Transformer(args).eval()
    hf_state_dict = _per_expert(reference)
    model.load_state_dict(hf.from_hf_state_dict(hf_state_dict, args), strict=True)
    return model


def _per_expert(reference: DeepseekV3ForCausalLM) -> dict[str, torch.Tensor]:
    """transformers' in-memory fused experts in the per-expert layout its folders hold."""
    out = {}
    for name, tensor in reference.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            for e, (gate, up) in enumerate(zip(*tensor.chunk(2, dim=1))):
                out[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate
                out[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = up
        elif name.endswith("experts.down_proj"):
            for e, down in enumerate(tensor):
                out[name.replace("down_proj", f"{e}.down_proj.weight")] = down
        else:
            out[name] = tensor
    return out


def test_671B_has_the_released_parameter_count():
    """The published 671B (main model, without the 14B multi-token-prediction module), counted on the meta device
    against transformers' DeepseekV3Config defaults, the released shape."""
    with torch.device("meta"):
        ours = DeepSeekV3Transformer(DEEPSEEK_V3_FLAVORS["671B"])
        reference = DeepseekV3ForCausalLM(DeepseekV3Config())
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in reference.parameters()) == 671_026_404_352
    # The released config.json: transformers' defaults with YaRN over 163,840 positions.
    released = DeepseekV3Config(max_position_embeddings=163840, rope_parameters=RELEASED_YARN).to_dict()
    assert hf.hf_config_mismatches(released, DEEPSEEK_V3_FLAVORS["671B"]) == []


RELEASED_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
                 "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip


def test_lite_is_16B_total():
    with torch.device("meta"):
        model = DeepSeekV3Transformer(DEEPSEEK_V3_FLAVORS["lite"])
    assert sum(p.numel() for p in model.parameters()) == 15_960_108_544


# The debug model with a query latent or none, and with YaRN (mscale and mscale_all_dim both set, an original context
# shorter than the 14 positions decoded, so the scaled frequencies and both scales are exercised).
CACHE_CASES = {
    "query-latent": {},
    "lite": {"q_lora_rank": 0},
    "query-latent-yarn": {"yarn": YarnScaling(4.0, 8, mscale=1.0, mscale_all_dim=0.7)},
}


@pytest.mark.parametrize("overrides", CACHE_CASES.values(), ids=CACHE_CASES.keys())
def test_generation_with_the_latent_cache_equals_decoding_without_a_cache(overrides):
    """Greedy decoding of 2 sequences: a 6-token prefill, then 8 tokens one at a time through the latent cache, each
    step's logits against a full forward over the sequence so far (no cache); and `generate_ids`, the generation entry
    point, picks the same tokens."""
    args = dataclasses.replace(get_flavor("deepseek_v3", "debugmodel"), max_seq_len=32, **overrides)
    model = DeepSeekV3Transformer(args).eval()
    model.init_weights(seed=0)
    tokens = torch.randint(0, args.vocab_size, (2, 6), generator=torch.Generator().manual_seed(3))
    model.setup_caches(2, 14)
    worst = 0.0
    with torch.no_grad():
        logits = model(tokens, start_pos=0)
        worst = (logits - model(tokens)).abs().max().item()
        for _ in range(8):
            tokens = torch.cat([tokens, logits[:, -1:].argmax(-1)], dim=1)
            logits = model(tokens[:, -1:], start_pos=tokens.shape[1] - 1)
            worst = max(worst, (logits[:, -1] - model(tokens)[:, -1]).abs().max().item())
    # measured: 1.4e-6 (query latent), 1.2e-6 (lite), 1.2e-6 (YaRN), on logits up to 3.9
    assert worst <= TOLERANCE
    assert isinstance(model.layers["0"].attention.kv_cache, LatentKVCache)

    model.clear_caches()
    ids = generate_ids(whole_model(model), tokens[0, :6].tolist(), 8, temperature=0, top_k=None, seed=0)
    assert ids == tokens[0, 6:].tolist()


def test_the_latent_cache_holds_the_latent_and_the_rope_key_per_position():
    """(kv_lora_rank + qk_rope_head_dim) numbers per position and layer, against Llama 3's KVCache of the expanded
    per-head keys and values (n_heads x (qk_head_dim + v_head_dim)): in the debug model (fp32) and, on the meta
    device, in the 671B model (bf16)."""
    for flavor, dtype, latent_bytes, per_head_bytes in (("debugmodel", torch.float32, 160, 640),
                                                         ("671B", torch.bfloat16, 1_152, 81_920)):  # fmt: skip
        args = DEEPSEEK_V3_FLAVORS[flavor]
        device = "cpu" if flavor == "debugmodel" else "meta"
        with torch.device(device):
            attention = MultiHeadLatentAttention(args).to(dtype)
            rope_cache = mla_rope_cache(args, device)[:4]
        attention.kv_cache = LatentKVCache(2, 4)
        with torch.no_grad():
            out = attention(torch.zeros(2, 3, args.dim, dtype=dtype, device=device), rope_cache, start_pos=0)
        cache = attention.kv_cache
        assert out.shape == (2, 3, args.dim)
        assert cache.latent.shape == (2, 4, args.kv_lora_rank) and cache.latent.dtype == dtype
        assert cache.rope_key.shape == (2, 4, args.qk_rope_head_dim) and cache.rope_key.dtype == dtype
        per_position = (cache.latent.nbytes + cache.rope_key.nbytes) // (2 * 4)
        per_head = KVCache(2, 4)
        per_head.update(0, torch.zeros(2, 1, args.n_heads, args.qk_head_dim, dtype=dtype, device=device),
                        torch.zeros(2, 1, args.n_heads, args.v_head_dim, dtype=dtype, device=device))  # fmt: skip
        per_head_per_position = (per_head.k.nbytes + per_head.v.nbytes) // (2 * 4)
        assert (per_position, per_head_per_position) == (latent_bytes, per_head_bytes)
        assert per_position == (args.kv_lora_rank + args.qk_rope_head_dim) * dtype.itemsize
    # 671B over its 61 layers: 70,272 bytes per position instead of 4,997,120 (71x fewer)
    assert 61 * 1_152 == 70_272 and 61 * 81_920 == 4_997_120


def test_bad_shapes_are_refused():
    spec = get_model_spec("deepseek_v3")
    with pytest.raises(ConfigError, match="n_heads = 4 is not divisible by parallelism.tensor_parallel_degree = 3"):
        spec.parallel.validate_tensor_parallel(spec.flavors["debugmodel"], 3)
    with pytest.raises(ConfigError, match="num_experts = 8 is not divisible by parallelism.expert_parallel_degree"):
        spec.parallel.validate_expert_parallel(spec.flavors["debugmodel"], 3)
    with pytest.raises(ConfigError, match="qk_rope_head_dim 7 must be even"):
        dataclasses.replace(spec.flavors["debugmodel"], qk_rope_head_dim=7)


def test_rope_keys_apply_theta_and_refuse_llama_scaling():
    def job(*keys: str) -> Model:
        return parse_args(JobConfig, ["--model.name", "deepseek_v3", *keys]).model

    flavor, where = get_flavor("deepseek_v3", "debugmodel"), "model.flavor = 'debugmodel'"
    assert with_rope(flavor, job("--model.rope_theta", "50000"), where).rope_theta == 50000
    with pytest.raises(ConfigError, match="model.rope_scaling_factor .* does not apply to model.name = 'deepseek_v3'"):
        with_rope(flavor, job("--model.rope_scaling_factor", "8", "--model.rope_original_max_seq_len", "1024"), where)


def test_hf_mapping_refuses_what_it_cannot_carry():
    args = DEEPSEEK_V3_FLAVORS["debugmodel"]
    state_dict = DeepSeekV3Transformer(args).state_dict()
    hf_state_dict = hf.to_hf_state_dict(state_dict, args)
    hf_state_dict["model.layers.1.mlp.gate.e_score_correction_bias"] = torch.ones(args.num_experts)
    unbalanced = dataclasses.replace(args, bias_update_rate=0.0)
    with pytest.raises(TorchpreError, match="model.layers.1.mlp.gate.e_score_correction_bias is not all zeros"):
        hf.from_hf_state_dict(hf_state_dict, unbalanced)
    with pytest.raises(TorchpreError, match="model.layers.2.mlp.experts.7.down_proj.weight"):
        hf.from_hf_state_dict({k: v for k, v in hf_state_dict.items() if "experts.7.down" not in k}, args)
    with pytest.raises(TorchpreError, match="shared_expert_hidden_dim = 48 is not a positive multiple"):
        hf.hf_config(dataclasses.replace(args, shared_expert_hidden_dim=48), bos_token_id=0, eos_token_id=1,
                     torch_dtype="float32")  # fmt: skip
    with pytest.raises(TorchpreError, match="rope_interleave = False is not supported"):
        hf.args_from_hf_config({"model_type": "deepseek_v3", "rope_interleave": False})
