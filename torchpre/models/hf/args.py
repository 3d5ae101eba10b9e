"""The args of `model.name = "hf"`: a transformers config read from `model.hf_config`, checked against the job."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchpre.config.job_config import JobConfig
from torchpre.errors import ConfigError, TorchpreError, UntrustedInput, resolve_step
from torchpre.json_input import JsonValue, read_json, read_named_json
from torchpre.models.args import ArgsDefaults
from torchpre.models.hf.architectures import not_decoder_only
from torchpre.models.hf.tiny import is_stochastic_key, stochastic_keys
from torchpre.models.hf_fields import (
    BOOLEAN,
    COUNT,
    NON_NEGATIVE,
    OBJECT,
    POSITIVE,
    POSITIVE_INT,
    STRING,
    Kind,
    check_divides,
    check_kinds,
)  # fmt: skip
from torchpre.optional import import_optional
from torchpre.step_rules.zero_stages import zero_stage

if TYPE_CHECKING:
    from transformers import PretrainedConfig

KEY = "model.hf_config"


@dataclass(frozen=True)
class HFArgs(ArgsDefaults):
    """A transformers config and what torchpre reads of it, in the names other families' args use. The config sets
    the shape and the forward: no model.* shape, parametrization or multi-token prediction keys apply."""

    config: PretrainedConfig
    path: str
    max_seq_len: int
    sequence_parallel: bool = False  # parallelism.enable_sequence_parallel (applies under tensor parallel)
    loss_parallel: bool = False  # parallelism.enable_loss_parallel (idem)
    fsdp: bool = False  # the ZeRO stage shards parameters (FSDP2)

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

    config: PretrainedConfig

    def __hash__(self) -> int:
        return hash(self.config.to_json_string())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ConfigKey) and self.config.to_json_string() == other.config.to_json_string()


@resolve_step
def hf_args(job: JobConfig, vocab_size: int, max_seq_len: int | None) -> HFArgs:
    """The transformers config at `model.hf_config` (a config.json or a folder holding one), checked against the
    job: the tokenizer's `vocab_size` ids must fit the model's vocabulary and `max_seq_len` (None: the model's
    own context) its positions."""
    path, values = _read_config(job.model.hf_config)
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
        check_values(values)
        config = transformers.AutoConfig.for_model(model_type, **fields)
        check_values(read_attributes(config))
    except TorchpreError as error:
        raise ConfigError(f"{KEY} = {path}: {error}") from None
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
        fsdp=zero_stage(job.optimizer.zero_stage).shards_parameters,
    )


def check_values(values: Mapping[str, Any]) -> None:
    """A TorchpreError naming the first field of a transformers config (its JSON, or `read_attributes`) whose value
    is not of its kind. transformers checks none of them: a size of 0 or "256" reaches a constructor or a division
    and ends in a traceback, a dropout of 1 (an integer) would train at random."""
    check_kinds(values, _KINDS)
    check_kinds(values, {key: _STOCHASTIC for key in values if is_stochastic_key(key)})
    check_divides(values, "num_key_value_heads", "num_attention_heads", "each key/value head serves a whole group")
    for key in ("rope_scaling", "rope_parameters"):  # transformers 5 nests rope_parameters per layer type
        rope = values.get(key) or {}
        nested = [(f"{key}.{name}.", value) for name, value in rope.items() if isinstance(value, dict)]
        for prefix, fields in [(f"{key}.", rope), *nested]:
            check_kinds(fields, _ROPE_KINDS, prefix)


def read_attributes(config: PretrainedConfig) -> dict[str, Any]:
    """The values torchpre reads of a built transformers config, under transformers' common names (a family's own
    names, e.g. GPT-2's n_embd, reach them through its attribute_map)."""
    return {name: getattr(config, name) for name in _READ if hasattr(config, name)}


# A size of every layer, or one per layer (Gemma 3n's intermediate_size).
_PER_LAYER_SIZE = Kind(
    lambda value: POSITIVE_INT.accepts(value) or (type(value) is list and all(map(POSITIVE_INT.accepts, value))),
    "a positive integer or a list of them",
)
# The fields of a transformers config torchpre reads, or that size the model transformers builds, and their kinds.
# Null is transformers' "unset" (GPT-Neo's intermediate_size is 4 x hidden_size; Cohere 2 MoE's unused rms_norm_eps),
# and a window or head size of 0 one it writes itself (Qwen 2 MoE's sliding_window with use_sliding_window off):
# every causal LM's own default config passes (tests/unit/test_foreign_inputs.py).
_KINDS = {
    "model_type": STRING, "vocab_size": POSITIVE_INT, "hidden_size": POSITIVE_INT,
    "intermediate_size": _PER_LAYER_SIZE.or_null(), "num_hidden_layers": POSITIVE_INT,
    "num_attention_heads": POSITIVE_INT,
    "num_key_value_heads": POSITIVE_INT.or_null(), "head_dim": COUNT.or_null(),
    "max_position_embeddings": POSITIVE_INT.or_null(), "sliding_window": COUNT.or_null(),
    "rms_norm_eps": POSITIVE.or_null(), "layer_norm_eps": POSITIVE.or_null(), "layer_norm_epsilon": POSITIVE.or_null(),
    "rope_theta": POSITIVE,
    "rope_scaling": OBJECT.or_null(), "rope_parameters": OBJECT.or_null(), "quantization_config": OBJECT.or_null(),
    "tie_word_embeddings": BOOLEAN, "is_encoder_decoder": BOOLEAN, "use_cache": BOOLEAN,
}  # fmt: skip
_READ = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
         "tie_word_embeddings", "is_encoder_decoder")  # fmt: skip
_ROPE_KINDS = {
    "rope_type": STRING, "type": STRING, "rope_theta": POSITIVE, "factor": POSITIVE,
    "original_max_position_embeddings": POSITIVE_INT, "low_freq_factor": POSITIVE, "high_freq_factor": POSITIVE,
    "beta_fast": POSITIVE, "beta_slow": POSITIVE, "attention_factor": POSITIVE.or_null(),
}  # fmt: skip
# A dropout, jitter or noise: a number (or null, or a switch), never text.
_STOCHASTIC = Kind(lambda value: value is None or type(value) is bool or NON_NEGATIVE.accepts(value),
                   "a number of 0 or more")  # fmt: skip


def _read_config(value: str) -> tuple[Path, dict[str, JsonValue]]:
    """The path model.hf_config names (a config.json, or a folder holding one) and the object it holds, bounded: a
    named file may be a link (the user's choice), a folder's config.json is read as every file of a Hugging Face
    folder is, never through a link (`json_input.read_json`)."""
    if not value:
        raise ConfigError(
            f"model.name = 'hf' needs {KEY}: the path of a transformers config.json (or of a folder holding one), "
            "e.g. --model.hf_config assets/hf_configs/llama_tiny.json."
        )
    named = Path(value)
    path = named / "config.json" if named.is_dir() else named
    try:
        values = read_json(named, "config.json", "config") if named.is_dir() else read_named_json(named, "config")
    except FileNotFoundError:
        raise ConfigError(
            f"{KEY} = {value}: {path} does not exist. Give a transformers config.json or its folder."
        ) from None
    except UntrustedInput as error:
        raise UntrustedInput(f"{KEY} = {value}: {error}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{KEY} = {path} holds a JSON {type(values).__name__}, not a config object.")
    return path, values
