"""`torchpre.convert` for `model.name = "hf"`: the checkpoint already uses transformers' parameter names, so
conversion checks names and shapes against the model and writes the config the job trained."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from torchpre.models.hf.args import HFArgs
from torchpre.models.hf.model import EMBEDDING, HEAD, HFCausalLM
from torchpre.models.state_dict_checks import check_tensors, without_tied_copy

# The keys of config.json that decide the weights' names and shapes.
SHAPE_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
)


def to_hf_state_dict(state_dict: Mapping[str, Tensor], args: HFArgs) -> dict[str, Tensor]:
    """The checkpoint's tensors under their own names, without the output copy of a tied embedding (transformers
    saves the embedding only), after checking them against the model."""
    if args.tie_word_embeddings:
        state_dict = without_tied_copy(state_dict, HEAD, EMBEDDING)
    check_tensors(state_dict, _shapes(args), "checkpoint")
    return dict(state_dict)


def from_hf_state_dict(hf_state_dict: Mapping[str, Tensor], args: HFArgs) -> dict[str, Tensor]:
    """A transformers state dict as the model's state dict (the tied output copy is the embedding tensor)."""
    if args.tie_word_embeddings:
        hf_state_dict = without_tied_copy(hf_state_dict, HEAD, EMBEDDING)
    check_tensors(hf_state_dict, _shapes(args), "Hugging Face state dict")
    state_dict = dict(hf_state_dict)
    if args.tie_word_embeddings:
        state_dict[HEAD] = state_dict[EMBEDDING]
    return state_dict


def hf_config(
    args: HFArgs, *, bos_token_id: int, eos_token_id: int, torch_dtype: str, max_position_embeddings: int | None = None
) -> dict[str, Any]:
    """The job's transformers config with the tokenizer's special ids and the weights' dtype."""
    config = args.config.to_dict()
    with torch.device("meta"):
        architecture = HFCausalLM(args).architecture
    config.update(
        architectures=[architecture],
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        torch_dtype=torch_dtype,
        dtype=torch_dtype,
        use_cache=True,
    )
    if max_position_embeddings is not None:
        config["max_position_embeddings"] = max(max_position_embeddings, config["max_position_embeddings"])
    return config


def hf_config_mismatches(config: Mapping[str, Any], args: HFArgs) -> list[str]:
    """The shape-deciding keys where a folder's config.json differs from the job's model.hf_config."""
    ours = args.config.to_dict()
    return [
        f"{key} = {config.get(key)!r}, but model.hf_config has {ours.get(key)!r}"
        for key in SHAPE_KEYS
        if key in config and config.get(key) != ours.get(key)
    ]


def _shapes(args: HFArgs) -> dict[str, torch.Size]:
    with torch.device("meta"):
        model = HFCausalLM(args)
    return {name: param.shape for name, param in model.named_parameters()}
