"""Every field of a Hugging Face `config.json` a family imports is read, fixed to the one value the family computes
with, known to change nothing it computes, or refused by name: a field nobody reads would be ignored silently, and
a released model whose config says something torchpre does not do would train as another model.

A family lists the fields it reads and those it fixes (`check_fields`); the fields below change nothing in any
family's weights or training forward, for the reason given.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from torchpre.errors import TorchpreError

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


def check_fields(
    config: Mapping[str, Any], read: Collection[str], fixed: Mapping[str, Any], family: str, prefix: str = ""
) -> None:
    """A TorchpreError for the first field of `config` that `family` neither reads (`read`), nor computes with at
    its one value (`fixed`: field -> value; a field that is absent takes it), nor lists as `IRRELEVANT` (top-level
    fields only; `prefix` names a nested dict's fields, e.g. "rope_parameters.")."""
    irrelevant = IRRELEVANT if not prefix else {}
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
