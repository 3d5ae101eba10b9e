"""`torchpre.convert` for `model.name = "hf"`: the checkpoint already uses transformers' parameter names, so
conversion checks names and shapes against the model and writes the config the job trained."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch
from torch import Tensor

from torchpre.errors import TorchpreError
from torchpre.models.hf.args import HFArgs, check_values
from torchpre.models.hf.model import meta_model, tied_weights
from torchpre.models.hf_fields import IRRELEVANT, shown
from torchpre.models.hf_sources import Copy, Same, Source, Sources, whole_state_dict
from torchpre.models.state_dict_checks import check_tensors, without_tied_copy


def to_hf_state_dict(state_dict: Mapping[str, Tensor], args: HFArgs) -> dict[str, Tensor]:
    """The checkpoint's tensors under their own names, without the output copy of a tied embedding (transformers
    saves the embedding only), after checking them against the model."""
    tied = tied_weights(args)
    if tied is not None:
        state_dict = without_tied_copy(state_dict, tied[1], tied[0])
    check_tensors(state_dict, _shapes(args), "checkpoint")
    return dict(state_dict)


def from_hf_state_dict(hf_state_dict: Mapping[str, Tensor], args: HFArgs) -> dict[str, Tensor]:
    """A transformers state dict as the model's state dict (the tied output copy is the embedding tensor)."""
    state_dict = whole_state_dict(hf_sources(args, hf_state_dict.keys()), _state_shapes(args), hf_state_dict)
    tied = tied_weights(args)
    if tied is not None:
        state_dict[tied[1]] = state_dict[tied[0]]
    return state_dict


def hf_sources(args: HFArgs, folder: Collection[str]) -> Sources:
    """Every tensor of the model's state dict from the folder tensor of its own name; a tied output layer from the
    embedding, whose saved copy, if the folder has one, must equal it."""
    by_name: dict[str, Source] = {name: Same(name) for name in _state_shapes(args)}
    tied = tied_weights(args)
    if tied is not None:
        embedding, output = tied
        if output in folder:
            why = "the model ties them; these weights belong to a model with untied embeddings"
            by_name[embedding] = Same(embedding, copies=(Copy(output, why),))
        by_name[output] = Same(embedding)
    return Sources(by_name)


def hf_config(
    args: HFArgs, *, bos_token_id: int, eos_token_id: int, torch_dtype: str, max_position_embeddings: int | None = None
) -> dict[str, Any]:
    """The job's transformers config with the tokenizer's special ids and the weights' dtype."""
    config = args.config.to_dict()
    config.update(
        architectures=[meta_model(args).architecture],
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        torch_dtype=torch_dtype,
        dtype=torch_dtype,
        use_cache=True,
    )
    context = type(args.config).attribute_map.get("max_position_embeddings", "max_position_embeddings")
    if max_position_embeddings is not None and context in config:
        config[context] = max(max_position_embeddings, config[context])
    return config


def hf_config_mismatches(config: Mapping[str, Any], args: HFArgs) -> list[str]:
    """Where the model a folder's config.json describes differs from the job's (model.hf_config), field by field as
    transformers reads both (its defaults filled in, RoPE in its current form): its model_type, or any field that can
    change what the model computes, which is every field but those `hf_fields.IRRELEVANT` lists (another rope_theta
    or rms_norm_eps has the same tensor shapes and trains another model)."""
    if config.get("model_type") != args.config.model_type:
        return [f"model_type = {config.get('model_type')!r}, but model.hf_config has {args.config.model_type!r}"]
    check_values(config)
    try:
        theirs = type(args.config).from_dict(dict(config)).to_dict()
    except (TypeError, ValueError, KeyError) as error:
        raise TorchpreError(f"transformers cannot build a '{args.config.model_type}' config from it: {error}") from None
    relevant = {key: value for key, value in args.config.to_dict().items() if key not in IRRELEVANT}
    return _differences({key: value for key, value in theirs.items() if key not in IRRELEVANT}, relevant)[:6]


def _differences(theirs: Mapping[str, Any], ours: Mapping[str, Any], prefix: str = "") -> list[str]:
    """'key = theirs, but model.hf_config has ours' for each field that differs, nested objects by their dotted keys
    (a field missing on one side shows as null)."""
    found = []
    for key in sorted(ours.keys() | theirs.keys()):
        mine, other = ours.get(key), theirs.get(key)
        if isinstance(mine, Mapping) and isinstance(other, Mapping):
            found += _differences(other, mine, f"{prefix}{key}.")
        elif mine != other:
            found.append(f"{prefix}{key} = {shown(other)}, but model.hf_config has {shown(mine)}")
    return found


def _shapes(args: HFArgs) -> dict[str, torch.Size]:
    return {name: param.shape for name, param in meta_model(args).named_parameters()}


def _state_shapes(args: HFArgs) -> dict[str, torch.Size]:
    """The shapes of the model's state dict: its parameters and persistent buffers, a tied copy under both names."""
    return {name: tensor.shape for name, tensor in meta_model(args).state_dict().items()}
