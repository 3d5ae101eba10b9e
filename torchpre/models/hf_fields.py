"""Every field of a Hugging Face `config.json` a family imports is read, fixed to the one value the family computes
with, known to change nothing it computes, or refused by name: a field nobody reads would be ignored silently, and
a released model whose config says something torchpre does not do would train as another model.

A family lists the fields it reads, each with the kind of value it must hold (`Kind`: a positive integer for a
size, a finite positive number for an epsilon, an object for RoPE scaling), and those it fixes (`check_fields`); the
fields below change nothing in any family's weights or training forward, for the reason given. A config.json comes
from whoever released the folder: a value of the wrong type or range is refused here, by name, before it reaches
arithmetic or a model constructor, where it would end in a traceback or a model that is not the folder's.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

from torchpre.errors import TorchpreError


@dataclass(frozen=True)
class Kind:
    """What a field must hold: `accepts` a parsed JSON value, `words` says what that is in a message."""

    accepts: Callable[[object], bool]
    words: str

    def or_null(self) -> Kind:
        """The same kind, or null (transformers writes null for "unset, take the default")."""
        return Kind(lambda value: value is None or self.accepts(value), f"{self.words} or null")


def _is_number(value: object) -> TypeGuard[int | float]:
    return type(value) in (int, float) and math.isfinite(value)


POSITIVE_INT = Kind(lambda value: type(value) is int and value > 0, "a positive integer")
COUNT = Kind(lambda value: type(value) is int and value >= 0, "an integer of 0 or more")
POSITIVE = Kind(lambda value: _is_number(value) and value > 0, "a finite positive number")
NON_NEGATIVE = Kind(lambda value: _is_number(value) and value >= 0, "a finite number of 0 or more")
PROBABILITY = Kind(lambda value: _is_number(value) and 0 <= value <= 1, "a number from 0 to 1")
BOOLEAN = Kind(lambda value: type(value) is bool, "true or false")
STRING = Kind(lambda value: type(value) is str, "a string")
OBJECT = Kind(lambda value: type(value) is dict, "an object")
ANY = Kind(lambda value: True, "any value")


def check_kinds(config: Mapping[str, object], kinds: Mapping[str, Kind], prefix: str = "") -> None:
    """A TorchpreError for the first field of `config` that `kinds` names and whose value is not of its kind (an
    absent field is the caller's default). `prefix` names a nested object's fields, e.g. "rope_parameters."."""
    for field, kind in kinds.items():
        if field in config and not kind.accepts(config[field]):
            raise TorchpreError(f"{prefix}{field} is {shown(config[field])}, not {kind.words}.")


def check_divides(config: Mapping[str, Any], divisor: str, dividend: str, why: str) -> None:
    """A TorchpreError unless the integer field `divisor` divides `dividend` (both checked positive, or absent or
    null: the caller's default then)."""
    if config.get(divisor) and config.get(dividend) and config[dividend] % config[divisor]:
        raise TorchpreError(
            f"{dividend} = {config[dividend]} is not divisible by {divisor} = {config[divisor]}: {why}."
        )


def shown(value: object) -> str:
    """A JSON value as the file shows it, shortened: null, "256", [...]."""
    text = json.dumps(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


IRRELEVANT: dict[str, str] = {
    "_name_or_path": "where transformers loaded the config from",
    "architectures": "the model_type names the family",
    "auto_map": "a folder's own modelling code, which torchpre never runs",
    "transformers_version": "the version that wrote the file",
    "torch_dtype": "each tensor's dtype is read from the safetensors files",
    "dtype": "each tensor's dtype is read from the safetensors files",
    "use_cache": "the KV cache of inference",
    "bos_token_id": "the tokenizer's (model.tokenizer_path)",
    "eos_token_id": "the tokenizer's (model.tokenizer_path)",
    "pad_token_id": "the tokenizer's (model.tokenizer_path)",
    "initializer_range": "initialisation, which loaded weights replace",
    "pretraining_tp": "how the original training split its matmuls; the product is the same",
    "output_attentions": "what transformers' forward returns",
    "output_hidden_states": "what transformers' forward returns",
    "return_dict": "what transformers' forward returns",
    "chunk_size_feed_forward": "transformers' memory-saving chunking of a forward; the result is the same",
    "id2label": "the labels of a classification head, which a causal LM has none of",
    "label2id": "the labels of a classification head, which a causal LM has none of",
    "problem_type": "the loss of a classification head, which a causal LM has none of",
    "tokenizer_class": "the tokenizer's (model.tokenizer_path)",
    "quantization_config": "read by the weights' reader: block-FP8 is dequantized, other methods are refused",
}
# The irrelevant fields that something else reads, with the kind it needs.
IRRELEVANT_KINDS = {"quantization_config": OBJECT.or_null()}


def check_fields(
    config: Mapping[str, Any], read: Mapping[str, Kind], fixed: Mapping[str, Any], family: str, prefix: str = ""
) -> None:
    """A TorchpreError for the first field of `config` that `family` neither reads (`read`: field -> its kind, which
    the value must be), nor computes with at its one value (`fixed`: field -> value; a field that is absent takes
    it), nor lists as `IRRELEVANT` (top-level fields only; `prefix` names a nested dict's fields, e.g.
    "rope_parameters.")."""
    irrelevant = IRRELEVANT if not prefix else {}
    check_kinds(config, {**read, **IRRELEVANT_KINDS} if not prefix else read, prefix)
    for field, value in fixed.items():
        if config.get(field, value) != value:
            raise TorchpreError(
                f"{prefix}{field} = {config[field]!r} is not supported (torchpre's {family} computes with {value!r})."
            )
    for field in config:
        if field not in read and field not in fixed and field not in irrelevant:
            raise TorchpreError(
                f"{prefix}{field} = {config[field]!r} is a field torchpre's {family} does not know: it would be "
                "ignored, and the model could compute something else than the folder's. Train the folder with "
                "model.name = 'hf' (transformers' own code), or remove the field if you know it changes nothing."
            )
