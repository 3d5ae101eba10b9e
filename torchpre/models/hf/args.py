"""The args of `model.name = "hf"`: a transformers config read from `model.hf_config`, checked against the job."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchpre.errors import ConfigError
from torchpre.optional import import_optional

# Decoder-only models whose layers follow Llama's layout (embed_tokens, layers of self_attn q/k/v/o_proj and
# mlp gate/up/down_proj, norm, rotary_emb, lm_head): the tensor-parallel plan and HFCausalLM's forward know them.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
KEY = "model.hf_config"


@dataclass(frozen=True)
class HFArgs:
    """A transformers config and what torchpre reads of it, in the names other families' args use."""

    config: Any  # transformers.PretrainedConfig
    path: str
    max_seq_len: int

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def dim(self) -> int:
        return self.config.hidden_size

    @property
    def n_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def n_heads(self) -> int:
        return self.config.num_attention_heads

    @property
    def n_kv_heads(self) -> int:
        return self.config.num_key_value_heads or self.config.num_attention_heads

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(self.config.tie_word_embeddings)


def hf_args(job: Any, vocab_size: int, max_seq_len: int | None) -> HFArgs:
    """The transformers config at `model.hf_config` (a config.json or a folder holding one), checked against the
    job: the tokenizer's `vocab_size` ids must fit the model's vocabulary and `max_seq_len` (None: the model's
    own context) its positions."""
    path = _config_path(job.model.hf_config)
    values = _read_json(path)
    model_type = values.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{KEY} = {path}: model_type = {model_type!r} is not one torchpre's Hugging Face support knows "
            f"({', '.join(SUPPORTED_MODEL_TYPES)}: Llama-layout decoders, whose tensor-parallel plan and pipeline "
            "stages it builds). For another architecture, build the model yourself and pass a plan to "
            "torchpre.parallel.parallelize (ParallelPlan(tensor_parallel={...module paths...}, blocks=...); see "
            "the README, 'Train a Hugging Face model'), or register a ModelSpec for it (job.custom_import)."
        )
    transformers = import_optional("transformers", "model.name = 'hf'", extra="hf")
    fields = {key: value for key, value in values.items() if key != "model_type"}
    try:
        config = transformers.AutoConfig.for_model(model_type, **fields)
    except (TypeError, ValueError, KeyError) as error:
        raise ConfigError(
            f"{KEY} = {path}: transformers cannot build a '{model_type}' config from it: {error}"
        ) from None
    config.use_cache = False  # training: no KV cache is kept
    if config.vocab_size < vocab_size:
        raise ConfigError(
            f"{KEY} = {path}: vocab_size = {config.vocab_size} is smaller than the tokenizer's {vocab_size} ids "
            "(model.tokenizer_path). Raise vocab_size in the config to at least that, or use a tokenizer whose "
            "ids fit."
        )
    context = config.max_position_embeddings
    if max_seq_len is not None and max_seq_len > context:
        raise ConfigError(
            f"training.seq_len = {max_seq_len} is longer than the model's max_position_embeddings = {context} "
            f"({path}). Lower training.seq_len or raise max_position_embeddings in the config."
        )
    seq_len = context if max_seq_len is None else max_seq_len
    _check_full_attention(config, path, seq_len)
    if job.training.document_mask:
        raise ConfigError(
            "training.document_mask is not supported with model.name = 'hf' (its attention runs one causal mask "
            "per row). Turn training.document_mask off."
        )
    return HFArgs(config=config, path=str(path), max_seq_len=seq_len)


def _config_path(value: str) -> Path:
    if not value:
        raise ConfigError(
            f"model.name = 'hf' needs {KEY}: the path of a transformers config.json (or of a folder holding one), "
            "e.g. --model.hf_config assets/hf_configs/llama_tiny.json."
        )
    path = Path(value)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"{KEY} = {value}: {path} does not exist. Give a transformers config.json or its folder.")
    return path


def _read_json(path: Path) -> dict[str, Any]:
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"{KEY} = {path} is not valid JSON ({error}). Give a transformers config.json.") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{KEY} = {path} holds a JSON {type(values).__name__}, not a config object.")
    return values


def _check_full_attention(config: Any, path: Path, seq_len: int) -> None:
    """HFCausalLM runs plain causal attention; a sliding window shorter than the sequence would change it."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    sliding = window is not None and (layer_types is None or "sliding_attention" in layer_types)
    if sliding and window < seq_len:
        raise ConfigError(
            f"{KEY} = {path}: sliding_window = {window} is shorter than the {seq_len}-token sequences, and "
            "torchpre runs these models with full causal attention. Lower training.seq_len to at most "
            f"{window}, or set sliding_window to null (or use_sliding_window to false) in the config."
        )
