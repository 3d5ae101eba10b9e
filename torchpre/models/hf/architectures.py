"""Which transformers models `model.name = "hf"` takes: the decoder-only causal LMs of the installed transformers.

They are read off transformers' own auto mappings, not listed by hand: every `model_type` whose
`AutoModelForCausalLM` class is a causal LM (`...ForCausalLM` or `...LMHeadModel`), except
- encoder families whose causal LM is their encoder run as a decoder (BERT, RoBERTa, ...: they have a masked-LM
  class) and encoder-decoder families whose causal LM is their decoder half (BART, Pegasus, ...: they have a
  sequence-to-sequence class), and configs that say `is_encoder_decoder`;
- composite models that wrap a text model with other towers (vision, audio, ...: a sub-config that is not the
  text model's own attention or feed-forward settings), whose causal LM needs inputs torchpre does not feed.
"""

from __future__ import annotations

import functools
from types import ModuleType

from torchpre.optional import import_optional

# Sub-configs that are parts of one decoder (MPT's attn_config, DBRX's attn/ffn configs), not other towers.
DECODER_PART_CONFIGS = ("attn_config", "ffn_config")


def _transformers() -> ModuleType:
    return import_optional("transformers", "model.name = 'hf'", extra="hf")


def _auto_mappings() -> ModuleType:
    return import_optional("transformers.models.auto.modeling_auto", "model.name = 'hf'", extra="hf")


@functools.cache
def causal_lm_classes() -> dict[str, str]:
    """model_type -> the name of its AutoModelForCausalLM class, for every causal LM transformers maps."""
    return dict(_auto_mappings().MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@functools.cache
def not_decoder_only(model_type: str) -> str | None:
    """Why `model_type` is not a decoder-only causal LM torchpre can train (None: it is one)."""
    auto = _auto_mappings()
    classes = causal_lm_classes()
    if model_type not in _transformers().CONFIG_MAPPING:
        return (
            f"the installed transformers ({_transformers().__version__}) does not know this model_type (misspelt, or "
            "added in a later transformers)"
        )
    if model_type in auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        causal = "its causal LM is the decoder half" if model_type in classes else "it has no causal LM"
        return f"it is an encoder-decoder family (sequence to sequence); {causal}"
    if model_type not in classes:
        return "transformers has no causal LM (AutoModelForCausalLM) for it"
    name = classes[model_type]
    if not name.endswith(("ForCausalLM", "LMHeadModel")):
        return f"its causal LM class {name} is a multimodal model (it needs inputs besides token ids)"
    if model_type in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "it is an encoder family (it has a masked LM); its causal LM is the encoder run as a decoder"
    config_class = _transformers().CONFIG_MAPPING[model_type]
    if getattr(config_class, "is_encoder_decoder", False):
        return "it is an encoder-decoder model (is_encoder_decoder)"
    towers = [key for key in getattr(config_class, "sub_configs", {}) if key not in DECODER_PART_CONFIGS]
    if towers:
        return f"it is a composite model (sub-configs {', '.join(towers)})"
    return None


def decoder_only_model_types() -> list[str]:
    """Every decoder-only causal LM model_type of the installed transformers, sorted."""
    return sorted(model_type for model_type in causal_lm_classes() if not_decoder_only(model_type) is None)
