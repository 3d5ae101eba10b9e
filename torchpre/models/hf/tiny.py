"""Tiny versions of transformers configs: the same architecture and switches, sizes small enough to build and run
in a fraction of a second on one CPU core.

`tiny_config(config)` keeps every key of `config` except the sizes below, which it sets wherever the config has
them (under the config's own name for the key: `n_embd` for GPT-2's `hidden_size`), and it truncates per-layer
lists to the tiny depth. torchpre probes an architecture on it before any work (`torchpre.models.hf.probe`), and
the support table (`docs/hf-models.md`) trains each architecture from the tiny version of its default config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchpre.optional import import_optional

if TYPE_CHECKING:
    from transformers import PretrainedConfig

VOCAB_SIZE = 2048  # torchpre's shipped tokenizer
LAYERS = 2
_HIDDEN, _HEADS, _HEAD_DIM, _FFN, _EXPERT_FFN, _CONTEXT = 64, 4, 16, 128, 32, 128

# Sizes by standard key, for every key of that name a config of this transformers version has (a key the config
# lacks is left alone). Head counts keep whole heads at tensor-parallel degree 2; windows cover the context.
SIZES: dict[str, int] = {
    "vocab_size": VOCAB_SIZE, "vocab_size_per_layer_input": VOCAB_SIZE, "unpadded_vocab_size": VOCAB_SIZE,
    "hidden_size": _HIDDEN, "embedding_dim": _HIDDEN, "word_embed_proj_dim": _HIDDEN, "lru_width": _HIDDEN,
    "attention_hidden_size": _HIDDEN, "dim_model_base": _HIDDEN,
    "num_hidden_layers": LAYERS, "num_layers": LAYERS, "decoder_layers": LAYERS, "num_blocks": LAYERS,
    "num_attention_heads": _HEADS, "num_heads": _HEADS, "attention_heads": _HEADS, "decoder_attention_heads": _HEADS,
    "swa_num_attention_heads": _HEADS, "mamba_n_heads": _HEADS, "mamba_num_heads": _HEADS,
    "linear_num_value_heads": _HEADS, "linear_num_heads": _HEADS,
    "num_key_value_heads": 2, "swa_num_key_value_heads": 2, "linear_num_key_heads": 2, "num_query_groups": 2,
    "index_n_heads": 2, "n_mamba_heads": 2, "o_groups": 2,
    "head_dim": _HEAD_DIM, "swa_head_dim": _HEAD_DIM, "kv_channels": _HEAD_DIM, "attention_head_dim": _HEAD_DIM,
    "dim_head": _HEAD_DIM, "d_head": _HEAD_DIM, "index_head_dim": _HEAD_DIM, "linear_key_head_dim": _HEAD_DIM,
    "linear_value_head_dim": _HEAD_DIM, "linear_head_dim": _HEAD_DIM, "v_head_dim": _HEAD_DIM,
    "qk_rope_head_dim": _HEAD_DIM, "qk_nope_head_dim": _HEAD_DIM, "qk_head_dim": 2 * _HEAD_DIM, "rotary_dim": 8,
    "mamba_d_head": 32, "mamba_headdim": 32, "mamba_head_dim": 32,
    "intermediate_size": _FFN, "n_inner": _FFN, "ffn_dim": _FFN, "dff": _FFN, "d_inner": _FFN, "dim_ff": _FFN,
    "ffn_hidden_size": _FFN, "intermediate_size_mlp": _FFN, "dense_intermediate_size": _FFN, "decoder_ffn_dim": _FFN,
    "mamba_d_ssm": _FFN,
    "moe_intermediate_size": _EXPERT_FFN, "expert_ffn_hidden_size": _EXPERT_FFN,
    "shared_expert_intermediate_size": 2 * _EXPERT_FFN, "shared_intermediate_size": 2 * _EXPERT_FFN,
    "shared_experts_intermediate_size": 2 * _EXPERT_FFN, "moe_shared_expert_intermediate_size": 2 * _EXPERT_FFN,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "moe_k": 2, "num_experts_per_token": 2,
    "n_group": 1, "topk_group": 1, "num_expert_group": 1, "first_k_dense_replace": 1, "num_dense_layers": 1,
    "kv_lora_rank": 16, "q_lora_rank": 32, "o_lora_rank": 16, "hc_lowrank": 16, "laurel_rank": 8, "adapter_rank": 8,
    "gated_norm_rank": 8, "loop_gate_rank": 8, "router_hidden_size": 16, "hidden_size_per_layer_input": 16,
    "ple_embed_dim": 16, "index_topk": 16,
    "mamba_d_state": 8, "state_size": 8, "ssm_state_size": 8, "mamba_dt_rank": 8, "time_step_rank": 8,
    "chunk_size": 16, "mamba_chunk_size": 16, "block_size": 16, "index_block_size": 16,
    "max_position_embeddings": _CONTEXT, "context_length": _CONTEXT, "n_ctx": _CONTEXT,
    "position_bias_max_distance": _CONTEXT, "position_bias_num_buckets": 32, "prompt_length": 4,
    "sliding_window": _CONTEXT, "attention_window_size": _CONTEXT, "window_size": _CONTEXT,
    "sliding_window_size": _CONTEXT, "local_attention": _CONTEXT, "attention_chunk_size": _CONTEXT,
}  # fmt: skip
# Sizes a config may leave None to derive them from others (head_dim from hidden_size and heads): set too.
DERIVED = ("head_dim", "num_key_value_heads")
SPECIAL_TOKENS = ("pad_token_id", "bos_token_id", "eos_token_id", "eod_token_id", "sep_token_id", "cls_token_id")


def tiny_config(config: PretrainedConfig, **changes: object) -> PretrainedConfig:
    """A config of `config`'s class with the tiny sizes (and `changes`); raises what transformers raises if it
    cannot build one."""
    values = config.to_dict()
    names = type(config).attribute_map
    layers = values.get(names.get("num_hidden_layers", "num_hidden_layers"))
    for key, size in SIZES.items():
        name = names.get(key, key)
        value = values.get(name, False)
        if (isinstance(value, int) and not isinstance(value, bool)) or (value is None and key in DERIVED):
            changes.setdefault(name, size)
    heads, kv_heads = (names.get(key, key) for key in ("num_attention_heads", "num_key_value_heads"))
    if values.get(kv_heads) == values.get(heads) and heads in changes:
        changes[kv_heads] = changes[heads]  # every head its own keys (multi-head or MLA attention): keep it so
    for name, value in values.items():
        if isinstance(value, list) and layers and len(value) == layers:
            changes[name] = value[:LAYERS]
    for index, name in enumerate(SPECIAL_TOKENS):
        if _out_of_vocabulary(values.get(name)):
            changes[name] = index
    return type(config).from_dict({**values, **changes})


def default_tiny_config(model_type: str) -> PretrainedConfig:
    """The tiny version of `model_type`'s default config, without dropout (the support table's model)."""
    default = import_optional("transformers", "model.name = 'hf'", extra="hf").CONFIG_MAPPING[model_type]()
    return tiny_config(default, **dict.fromkeys(stochastic_keys(default), 0.0))


def is_stochastic_key(name: str) -> bool:
    """Whether a config key sets a random part of the training forward (dropout, jitter, noise)."""
    return any(word in name for word in ("dropout", "pdrop", "jitter", "noise"))


def stochastic_keys(config: PretrainedConfig) -> list[str]:
    """The config keys that make a training forward random (dropout, jitter, noise) with a non-zero value."""
    return [
        name
        for name, value in config.to_dict().items()
        if is_stochastic_key(name) and type(value) in (int, float) and value > 0
    ]


def _out_of_vocabulary(token: object) -> bool:
    tokens = token if isinstance(token, list) else [token]
    return any(isinstance(t, int) and t >= VOCAB_SIZE for t in tokens)
