"""The args of `model.name = "hf"`: a transformers config read from `model.hf_config`, checked against the job."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchpre.errors import ConfigError
from torchpre.models.hf.architectures import not_decoder_only
from torchpre.models.hf.tiny import stochastic_keys
from torchpre.optional import import_optional

KEY = "model.hf_config"


@dataclass(frozen=True)
class HFArgs:
    """A transformers config and what torchpre reads of it, in the names other families' args use."""

    config: Any  # transformers.PretrainedConfig
    path: str
    max_seq_len: int
    sequence_parallel: bool = False  # parallelism.enable_sequence_parallel (applies under tensor parallel)
    loss_parallel: bool = False  # parallelism.enable_loss_parallel (idem)
    fsdp: bool = False  # optimizer.zero_stage = 3

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
        return getattr(self.config, "num_attention_heads", None) or 1

    @property
    def n_kv_heads(self) -> int:
        return getattr(self.config, "num_key_value_heads", None) or self.n_heads

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(getattr(self.config, "tie_word_embeddings", False))


@dataclass(frozen=True, eq=False)
class ConfigKey:
    """A transformers config as a cache key (configs are mutable and unhashable): equal when their JSON is."""

    config: Any

    def __hash__(self) -> int:
        return hash(self.config.to_json_string())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ConfigKey) and self.config.to_json_string() == other.config.to_json_string()


def hf_args(job: Any, vocab_size: int, max_seq_len: int | None) -> HFArgs:
    """The transformers config at `model.hf_config` (a config.json or a folder holding one), checked against the
    job: the tokenizer's `vocab_size` ids must fit the model's vocabulary and `max_seq_len` (None: the model's
    own context) its positions."""
    path = _config_path(job.model.hf_config)
    values = _read_json(path)
    model_type = values.get("model_type")
    why = not_decoder_only(model_type) if isinstance(model_type, str) else "the config has no model_type"
    if why is not None:
        raise ConfigError(
            f"{KEY} = {path}: model_type = {model_type!r} is not a model torchpre trains: {why}. model.name = 'hf' "
            "trains the decoder-only causal LMs of the installed transformers (docs/hf-models.md lists them)."
        )
    transformers = import_optional("transformers", "model.name = 'hf'", extra="hf")
    # transformers writes Infinity and NaN as {"__float__": "Infinity"}; its own reader turns them back.
    values = transformers.PretrainedConfig._decode_special_floats(values)
    fields = {key: value for key, value in values.items() if key != "model_type"}
    try:
        config = transformers.AutoConfig.for_model(model_type, **fields)
    except (TypeError, ValueError, KeyError) as error:
        raise ConfigError(
            f"{KEY} = {path}: transformers cannot build a '{model_type}' config from it: {error}"
        ) from None
    if getattr(config, "is_encoder_decoder", False):
        raise ConfigError(
            f"{KEY} = {path}: is_encoder_decoder = true, but model_type = '{model_type}' is a decoder-only causal LM "
            "and torchpre trains it as one. Remove is_encoder_decoder from the config (or set it to false)."
        )
    config.use_cache = False  # training: no KV cache is kept
    random = stochastic_keys(config)
    if random:
        raise ConfigError(
            f"{KEY} = {path}: {', '.join(f'{name} = {getattr(config, name)}' for name in random)}: a random training "
            "forward (dropout, router jitter) draws differently under each parallel layout, so torchpre's layouts "
            "would not give one process's losses. Set them to 0.0 (pretraining runs without dropout)."
        )
    if config.vocab_size < vocab_size:
        raise ConfigError(
            f"{KEY} = {path}: vocab_size = {config.vocab_size} is smaller than the tokenizer's {vocab_size} ids "
            "(model.tokenizer_path). Raise vocab_size in the config to at least that, or use a tokenizer whose "
            "ids fit."
        )
    context = getattr(config, "max_position_embeddings", None)
    context = context if isinstance(context, int) and context > 0 else max_seq_len or 0  # no limit of its own
    if max_seq_len is not None and max_seq_len > context:
        raise ConfigError(
            f"training.seq_len = {max_seq_len} is longer than the model's max_position_embeddings = {context} "
            f"({path}). Lower training.seq_len or raise max_position_embeddings in the config."
        )
    seq_len = context if max_seq_len is None else max_seq_len
    if job.training.document_mask:
        raise ConfigError(
            "training.document_mask is not supported with model.name = 'hf' (transformers' models take no "
            "document boundaries from torchpre). Turn training.document_mask off."
        )
    return HFArgs(
        config=config,
        path=str(path),
        max_seq_len=seq_len,
        sequence_parallel=job.parallelism.enable_sequence_parallel,
        loss_parallel=job.parallelism.enable_loss_parallel,
        fsdp=job.optimizer.zero_stage == 3,
    )


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
