"""Llama 3 weights and config to and from the Hugging Face `LlamaForCausalLM` format.

Pure functions on state dicts (FQN -> tensor) and config dicts; reading and writing files is
`torchpre.convert`'s job. Two things differ beyond names:
- RoPE: torchpre rotates adjacent pairs (x[2i], x[2i+1]) (Meta's layout), Hugging Face rotates
  x[i] with x[i + head_dim/2] (`rotate_half`). Permuting the output rows of wq and wk within each
  head makes the two compute the same attention scores (as Hugging Face's
  convert_llama_weights_to_hf.py does); wv and wo are untouched.
- Tied embeddings: torchpre's state dict has `output.weight` as the embedding itself (or as an
  equal copy on a pipeline stage); Hugging Face omits `lm_head.weight` or repeats it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

import torch
from torch import Tensor

from torchpre.errors import TorchpreError
from torchpre.models.hf_fields import (
    BOOLEAN,
    OBJECT,
    POSITIVE,
    POSITIVE_INT,
    STRING,
    check_divides,
    check_fields,
    check_kinds,
)
from torchpre.models.hf_sources import Copy, RotaryRows, Same, Source, Sources, whole_state_dict
from torchpre.models.llama3.args import RopeScaling, TransformerArgs
from torchpre.models.llama3.model import Transformer
from torchpre.models.parametrization import fold_multipliers
from torchpre.models.state_dict_checks import check_tensors, without_tied_copy

_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PER_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TIED = "output.weight"
_TIED_HF = "lm_head.weight"
# The weights whose outputs a parametrization's multipliers scale (torchpre.models.parametrization.fold_multipliers).
_MULTIPLIED = {
    "embedding": ("tok_embeddings.weight",),
    "logits": ("output.weight",),
    "queries": ("layers.*.attention.wq.weight",),
    "residual": ("layers.*.attention.wo.weight", "layers.*.feed_forward.w2.weight"),
}

# The config.json fields Llama 3's args are read from, each with the kind of value it must hold, and those with the
# one value torchpre's Llama computes with.
_READ = {
    "model_type": STRING, "hidden_size": POSITIVE_INT, "intermediate_size": POSITIVE_INT,
    "num_hidden_layers": POSITIVE_INT, "num_attention_heads": POSITIVE_INT,
    "num_key_value_heads": POSITIVE_INT.or_null(), "head_dim": POSITIVE_INT.or_null(), "vocab_size": POSITIVE_INT,
    "rms_norm_eps": POSITIVE, "rope_theta": POSITIVE, "rope_scaling": OBJECT.or_null(),
    "rope_parameters": OBJECT.or_null(), "max_position_embeddings": POSITIVE_INT, "tie_word_embeddings": BOOLEAN,
}  # fmt: skip
_FIXED = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
          "is_encoder_decoder": False}  # fmt: skip
_ROPE_NAMES = {"rope_type": STRING, "type": STRING, "rope_theta": POSITIVE}
_ROPE_READ = {
    "default": _ROPE_NAMES,
    "llama3": _ROPE_NAMES | {"factor": POSITIVE, "low_freq_factor": POSITIVE, "high_freq_factor": POSITIVE,
                             "original_max_position_embeddings": POSITIVE_INT},
}  # fmt: skip

# (TransformerArgs attribute, Hugging Face config key) pairs that must agree for weights to load.
_COMPARED_FIELDS = [
    ("dim", "hidden_size"),
    ("n_layers", "num_hidden_layers"),
    ("n_heads", "num_attention_heads"),
    ("n_kv_heads", "num_key_value_heads"),
    ("ffn_hidden_dim", "intermediate_size"),
    ("vocab_size", "vocab_size"),
    ("norm_eps", "rms_norm_eps"),
    ("rope_theta", "rope_theta"),
    ("rope_scaling", "rope_scaling"),
    ("tie_word_embeddings", "tie_word_embeddings"),
]


def to_hf_state_dict(state_dict: Mapping[str, Tensor], args: TransformerArgs) -> dict[str, Tensor]:
    """torchpre FQNs -> Hugging Face names, wq/wk rows permuted to the rotate-half layout.

    With tied embeddings `output.weight` may be present (equal to the embedding) or not; it is
    dropped, as Hugging Face saves only `model.embed_tokens.weight`. Raises TorchpreError naming
    missing, unknown or misshapen tensors.
    """
    shapes = _torchpre_shapes(args)
    if args.tie_word_embeddings:
        state_dict = without_tied_copy(state_dict, _TIED, "tok_embeddings.weight")
        del shapes[_TIED]
    check_tensors(state_dict, shapes, "torchpre model state dict")
    if not _as_granite(args):
        state_dict = fold_multipliers(state_dict, args.parametrization, _MULTIPLIED, args.tie_word_embeddings)
    return {_hf_name(fqn): _to_rotate_half(fqn, tensor, args) for fqn, tensor in state_dict.items()}


def _as_granite(args: TransformerArgs) -> bool:
    """A µP model with tied embeddings exports as Granite, whose config carries the multipliers that cannot fold into
    the one matrix both ends use; every other model as Llama, its multipliers folded into its weights."""
    return args.tie_word_embeddings and not args.parametrization.is_standard


def from_hf_state_dict(hf_state_dict: Mapping[str, Tensor], args: TransformerArgs) -> dict[str, Tensor]:
    """Hugging Face names -> torchpre FQNs, the inverse of `to_hf_state_dict` (read through `hf_sources`).

    With tied embeddings `lm_head.weight` may be present (equal to the embedding) or not, and
    `output.weight` is the embedding tensor itself, as in `Transformer.state_dict()`.
    """
    state_dict = whole_state_dict(hf_sources(args, hf_state_dict.keys()), _torchpre_shapes(args), hf_state_dict)
    if args.tie_word_embeddings:
        state_dict[_TIED] = state_dict["tok_embeddings.weight"]
    return state_dict


def hf_sources(args: TransformerArgs, folder: Collection[str]) -> Sources:
    """Where each tensor of `Transformer(args)` comes from in a folder holding the tensors named `folder`: wq and
    wk with their rows moved within each head, the tied output layer from the embedding (whose saved copy, if the
    folder has one, must equal it)."""
    by_name: dict[str, Source] = {}
    for fqn in _torchpre_shapes(args):
        name = _hf_name(fqn)
        rotary = fqn.endswith(("attention.wq.weight", "attention.wk.weight"))
        by_name[fqn] = RotaryRows(name, args.head_dim) if rotary else Same(name)
    if args.tie_word_embeddings:
        embedding = "model.embed_tokens.weight"
        if _TIED_HF in folder:
            why = "the model ties them (tie_word_embeddings); these weights belong to a model with untied embeddings"
            by_name["tok_embeddings.weight"] = Same(embedding, copies=(Copy(_TIED_HF, why),))
        by_name[_TIED] = Same(embedding)
    return Sources(by_name)


def hf_config(
    args: TransformerArgs,
    *,
    bos_token_id: int,
    eos_token_id: int,
    torch_dtype: str,
    max_position_embeddings: int | None = None,
) -> dict[str, Any]:
    """The `config.json` of a `LlamaForCausalLM` with these args (Llama 3.1 style keys, which
    transformers 4.x and 5.x both read), or of a `GraniteForCausalLM` with the parametrization's multipliers (a µP
    model with tied embeddings). `max_position_embeddings` defaults to args.max_seq_len."""
    scaling, granite = args.rope_scaling, _as_granite(args)
    p = args.parametrization
    multipliers = {
        "embedding_multiplier": p.embedding_multiplier,
        "logits_scaling": 1 / p.logit_multiplier,  # Granite divides the logits by it
        "residual_multiplier": p.residual_multiplier,
        "attention_multiplier": p.attention_multiplier * args.head_dim**-0.5,  # Granite's softmax scale itself
    }
    return {
        "architectures": ["GraniteForCausalLM" if granite else "LlamaForCausalLM"],
        "model_type": "granite" if granite else "llama",
        **(multipliers if granite else {}),
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None
        if scaling is None
        else {
            "rope_type": "llama3",
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
        },
        "max_position_embeddings": max_position_embeddings or args.max_seq_len,
        "tie_word_embeddings": args.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": torch_dtype,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
    }


def args_from_hf_config(config: Mapping[str, Any]) -> TransformerArgs:
    """The TransformerArgs a Hugging Face Llama `config.json` describes; missing optional keys take
    transformers' defaults. Every field is read or refused (`_READ`, `_FIXED`, `torchpre.models.hf_fields`):
    a TorchpreError names the first one torchpre's Llama cannot express.

    Reads both the 4.x keys (`rope_theta`, `rope_scaling`) and 5.x's `rope_parameters`.
    """
    if config.get("model_type") != "llama":
        raise TorchpreError(f"model_type is {config.get('model_type')!r}; only 'llama' configs can be converted.")
    check_fields(config, _READ, _FIXED, "llama3")
    required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    missing = [key for key in required if key not in config]
    if missing:
        raise TorchpreError(f"the config lacks {', '.join(missing)}.")
    check_divides(config, "num_attention_heads", "hidden_size", "each head is hidden_size / num_attention_heads wide")
    check_divides(config, "num_key_value_heads", "num_attention_heads", "each key/value head serves a whole group")
    dim, n_heads, hidden = config["hidden_size"], config["num_attention_heads"], config["intermediate_size"]
    if config.get("head_dim") not in (None, dim // n_heads):
        raise TorchpreError(
            f"head_dim = {config['head_dim']} is not hidden_size / num_attention_heads = {dim // n_heads}; "
            "torchpre's Llama derives head_dim from them."
        )
    rope_key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    rope = config.get(rope_key) or {}
    # TransformerArgs derives the MLP width as multiple_of * ceil(h / multiple_of) from
    # h = int(8 * dim / 3) (times ffn_dim_multiplier). With multiple_of = intermediate_size, and a
    # multiplier that brings h down to it when it is narrower, that is exactly intermediate_size.
    base = int(2 * 4 * dim / 3)
    return TransformerArgs(
        dim=dim,
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        vocab_size=config["vocab_size"],
        multiple_of=hidden,
        ffn_dim_multiplier=hidden / base if hidden < base else None,
        norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", config.get("rope_theta", 10000.0)),
        rope_scaling=_rope_scaling(rope, f"{rope_key}."),
        max_seq_len=config.get("max_position_embeddings", 2048),
        tie_word_embeddings=config.get("tie_word_embeddings", False),
    )


def hf_config_mismatches(config: Mapping[str, Any], args: TransformerArgs) -> list[str]:
    """Every field where a Hugging Face config disagrees with `args`, as 'key = theirs, but ours'
    lines; empty when its weights load into `Transformer(args)`. max_position_embeddings is not
    compared: it does not change the weights."""
    theirs = args_from_hf_config(config)
    return [
        f"{hf_key} = {getattr(theirs, field)!r} in the Hugging Face config, but the job's model has "
        f"{field} = {getattr(args, field)!r}"
        for field, hf_key in _COMPARED_FIELDS
        if getattr(theirs, field) != getattr(args, field)
    ]


def _rope_scaling(rope: Mapping[str, Any], prefix: str) -> RopeScaling | None:
    """The Llama 3.1 scaling of a config's RoPE object (`prefix`: its key and a dot), None for plain RoPE."""
    check_kinds(rope, _ROPE_NAMES, prefix)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in _ROPE_READ:
        raise TorchpreError(f"rope_type = {rope_type!r} is not supported; torchpre's Llama has 'default' and 'llama3'.")
    check_fields(rope, _ROPE_READ[rope_type], {}, "llama3", prefix=prefix)
    if rope_type == "default":
        return None
    missing = [f.name for f in dataclasses.fields(RopeScaling) if f.name not in rope]
    if missing:
        raise TorchpreError(f"the llama3 RoPE scaling lacks {', '.join(missing)}.")
    return RopeScaling(**{f.name: rope[f.name] for f in dataclasses.fields(RopeScaling)})


def _torchpre_shapes(args: TransformerArgs) -> dict[str, torch.Size]:
    """FQN -> shape of every tensor in `Transformer(args).state_dict()` (the tied copy of the embedding included);
    built on the meta device, so it costs no memory."""
    with torch.device("meta"):
        return {fqn: t.shape for fqn, t in Transformer(args).state_dict().items()}


def _hf_name(fqn: str) -> str:
    if fqn in _TOP_LEVEL:
        return _TOP_LEVEL[fqn]
    _, layer, name = fqn.split(".", 2)  # layers.{i}.{name}
    return f"model.layers.{layer}.{_PER_LAYER[name]}"


def _to_rotate_half(fqn: str, weight: Tensor, args: TransformerArgs) -> Tensor:
    """wq/wk rows from interleaved pairs (h, i, pair) to halves (h, pair, i); `RotaryRows` reads them back."""
    if not fqn.endswith(("attention.wq.weight", "attention.wk.weight")):
        return weight
    heads = weight.shape[0] // args.head_dim
    return weight.reshape(heads, args.head_dim // 2, 2, args.dim).transpose(1, 2).reshape(weight.shape)
