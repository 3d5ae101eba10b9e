"""DeepSeek-V3 weights and config to and from the Hugging Face `DeepseekV3ForCausalLM` format.

Pure functions on state dicts (FQN -> tensor) and config dicts; reading and writing files is `torchpre.convert`'s
job. Beyond names:
- Routed experts: torchpre stacks them ([experts, dim, hidden] `w1`/`w3`, [experts, hidden, dim] `w2`), the
  released folders hold one `nn.Linear` weight per expert (`mlp.experts.{e}.gate_proj.weight` [hidden, dim], ...),
  which is also what transformers' `save_pretrained` writes and `from_pretrained` reads.
- RoPE: both rotate adjacent pairs of the RoPE dimensions (the released layout, `rope_interleave = True`), so no
  rows move. A folder with `rope_interleave = false` is refused.
- The balancing bias is `e_score_correction_bias`; a model without bias balancing exports zeros there (transformers
  always has it) and imports only zeros.
- Multi-token prediction depth k is layer n_layers + k - 1, as released (layer 61 of the 671B model): its block under
  the layer names, `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, and copies of the embedding and output layer
  (`embed_tokens`, `shared_head.head`), which an import checks are equal to the model's. transformers ignores these
  layers; a job without multi-token prediction (model.mtp_depth = 0) drops them on import, since
  `num_nextn_predict_layers` (which transformers writes as 1 for models without the layers) does not say whether
  a folder holds them.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch
from torch import Tensor

from torchpre.errors import TorchpreError
from torchpre.models.deepseek_v3.args import DeepSeekV3Args, YarnScaling
from torchpre.models.deepseek_v3.model import DeepSeekV3Transformer
from torchpre.models.hf_fields import (
    BOOLEAN,
    COUNT,
    NON_NEGATIVE,
    OBJECT,
    POSITIVE,
    POSITIVE_INT,
    STRING,
    check_divides,
    check_fields,
    check_kinds,
)  # fmt: skip
from torchpre.models.hf_sources import Copy, Same, Source, Sources, StackedExperts, Zeros, whole_state_dict
from torchpre.models.parametrization import fold_multipliers
from torchpre.models.state_dict_checks import check_tensors, without_tied_copy

_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PER_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "moe.router.weight": "mlp.gate.weight",
    "moe.expert_bias": "mlp.gate.e_score_correction_bias",
    "moe.shared_expert.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_expert.w3.weight": "mlp.shared_experts.up_proj.weight",
    "moe.shared_expert.w2.weight": "mlp.shared_experts.down_proj.weight",
}
_EXPERTS = {"moe.experts.w1": "gate_proj", "moe.experts.w3": "up_proj", "moe.experts.w2": "down_proj"}
_MTP = {
    "embedding_norm.weight": "enorm.weight",
    "hidden_norm.weight": "hnorm.weight",
    "projection.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
}
_MTP_EMBEDDING = "mtp_embeddings.weight"  # the embedding's second name (its own Parameter on the last stage)
_TIED = "output.weight"  # with tied embeddings, the embedding's second name (transformers saves no lm_head.weight)
# The weights whose outputs a parametrization's multipliers scale, in the layers and the multi-token prediction blocks
# (torchpre.models.parametrization.fold_multipliers): the queries' scale goes into their last projection.
_MULTIPLIED = {
    "embedding": ("tok_embeddings.weight",),
    "logits": ("output.weight",),
    "queries": ("*.attention.wq.weight", "*.attention.wq_b.weight"),
    "residual": (
        "*.attention.wo.weight", "*.feed_forward.w2.weight", "*.moe.experts.w2", "*.moe.shared_expert.w2.weight",
    ),
}
# Each multi-token prediction layer's copies of the model's embedding and output layer.
_MTP_COPIES = {"tok_embeddings.weight": "embed_tokens.weight", "output.weight": "shared_head.head.weight"}

# The config.json fields DeepSeek-V3's args are read from, each with the kind of value it must hold, and those with
# the one value torchpre's computes with.
_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
_READ = {
    "model_type": STRING, "hidden_size": POSITIVE_INT, "num_hidden_layers": POSITIVE_INT,
    "num_attention_heads": POSITIVE_INT, "num_key_value_heads": POSITIVE_INT.or_null(),
    "head_dim": POSITIVE_INT.or_null(), "qk_head_dim": POSITIVE_INT.or_null(), "vocab_size": POSITIVE_INT,
    "max_position_embeddings": POSITIVE_INT, "rms_norm_eps": POSITIVE, "rope_theta": POSITIVE,
    "rope_scaling": OBJECT.or_null(), "rope_parameters": OBJECT.or_null(), "tie_word_embeddings": BOOLEAN,
    "q_lora_rank": COUNT.or_null(), "kv_lora_rank": POSITIVE_INT, "qk_nope_head_dim": POSITIVE_INT,
    "qk_rope_head_dim": POSITIVE_INT, "v_head_dim": POSITIVE_INT, "intermediate_size": POSITIVE_INT,
    "n_routed_experts": POSITIVE_INT, "num_experts_per_tok": POSITIVE_INT, "moe_intermediate_size": POSITIVE_INT,
    "n_shared_experts": POSITIVE_INT, "n_group": POSITIVE_INT, "topk_group": POSITIVE_INT,
    "norm_topk_prob": BOOLEAN, "routed_scaling_factor": POSITIVE, "aux_loss_alpha": NON_NEGATIVE,
    "first_k_dense_replace": COUNT,
    # Read by the job instead: its multi-token prediction depths are model.mtp_depth (transformers writes 1 for
    # folders without the layers), its expert parallelism parallelism.expert_parallel_degree.
    "num_nextn_predict_layers": COUNT, "ep_size": POSITIVE_INT,
}  # fmt: skip
_FIXED = {
    "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "rope_interleave": True,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1, "seq_aux": True,
    "output_router_logits": False, "is_encoder_decoder": False,
}  # fmt: skip
_ROPE_NAMES = {"rope_type": STRING, "type": STRING, "rope_theta": POSITIVE}
_ROPE_READ = {
    "default": _ROPE_NAMES,
    "yarn": _ROPE_NAMES | {
        "factor": POSITIVE.or_null(), "original_max_position_embeddings": POSITIVE_INT,
        "beta_fast": POSITIVE.or_null(), "beta_slow": POSITIVE.or_null(), "mscale": NON_NEGATIVE.or_null(),
        "mscale_all_dim": NON_NEGATIVE.or_null(), "attention_factor": POSITIVE.or_null(), "truncate": BOOLEAN,
    },
}  # fmt: skip

# DeepSeekV3Args fields that must agree with a Hugging Face config for its weights to load and compute the same.
_COMPARED_FIELDS = (
    "dim", "n_layers", "n_heads", "vocab_size", "norm_eps", "rope_theta", "yarn", "q_lora_rank", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "dense_hidden_dim", "num_experts", "top_k",
    "moe_hidden_dim", "shared_expert_hidden_dim", "score_func", "n_group", "topk_group", "norm_topk_prob",
    "routed_scaling_factor", "first_k_dense", "tie_word_embeddings",
)  # fmt: skip


def to_hf_state_dict(state_dict: Mapping[str, Tensor], args: DeepSeekV3Args) -> dict[str, Tensor]:
    """torchpre FQNs -> Hugging Face names, each routed expert's weights as their own `nn.Linear` weights, a
    parametrization's multipliers folded into the weights they scale. Raises TorchpreError naming missing, unknown or
    misshapen tensors."""
    state_dict = {fqn: t for fqn, t in state_dict.items() if fqn != _MTP_EMBEDDING}  # the embedding's alias
    shapes = {fqn: shape for fqn, shape in _torchpre_shapes(args).items() if fqn != _MTP_EMBEDDING}
    if args.tie_word_embeddings:
        state_dict = without_tied_copy(state_dict, _TIED, "tok_embeddings.weight")
        del shapes[_TIED]
    check_tensors(state_dict, shapes, "torchpre model state dict")
    state_dict = fold_multipliers(state_dict, args.parametrization, _MULTIPLIED, args.tie_word_embeddings)
    hf: dict[str, Tensor] = {}
    for fqn, tensor in state_dict.items():
        names = _hf_names(fqn, args)
        if _is_experts(fqn):
            hf |= {name: weight.t().contiguous() for name, weight in zip(names, tensor.unbind(0), strict=True)}
        else:
            hf[names[0]] = tensor
    for layer in _mtp_layers(args):
        # Copies, not views: a safetensors file refuses tensors that share memory.
        hf |= {f"model.layers.{layer}.{name}": state_dict[fqn].clone() for fqn, name in _MTP_COPIES.items()}
    if args.bias_update_rate == 0:  # transformers' router always has the bias: zeros leave its choice unchanged
        for layer in _routed_layers(args):
            hf[f"model.layers.{layer}.{_PER_LAYER['moe.expert_bias']}"] = torch.zeros(args.num_experts)
    return hf


def _mtp_layers(args: DeepSeekV3Args) -> range:
    """The Hugging Face layer indices of the multi-token prediction depths."""
    return range(args.n_layers, args.n_layers + args.mtp_depth)


def _routed_layers(args: DeepSeekV3Args) -> list[int]:
    """The Hugging Face layer indices with routed experts, multi-token prediction layers included."""
    return [*args.moe_layer_ids, *(_mtp_layers(args) if args.mtp_block_is_moe else ())]


def from_hf_state_dict(hf_state_dict: Mapping[str, Tensor], args: DeepSeekV3Args) -> dict[str, Tensor]:
    """Hugging Face names -> torchpre FQNs, the inverse of `to_hf_state_dict` (read through `hf_sources`)."""
    state_dict = whole_state_dict(hf_sources(args, hf_state_dict.keys()), _torchpre_shapes(args), hf_state_dict)
    if args.mtp_depth:
        state_dict[_MTP_EMBEDDING] = state_dict["tok_embeddings.weight"]
    if args.tie_word_embeddings:
        state_dict[_TIED] = state_dict["tok_embeddings.weight"]
    return state_dict


def hf_sources(args: DeepSeekV3Args, folder: Collection[str]) -> Sources:
    """Where each tensor of `DeepSeekV3Transformer(args)` comes from in a folder holding the tensors named `folder`:
    routed experts stacked, multi-token prediction's copies of the embedding and output layer checked against them,
    routing biases a model without bias balancing has no place for checked to be zeros, and the layers past the
    job's multi-token prediction depths dropped. With tied embeddings the output layer is the embedding, whose saved
    copy (`lm_head.weight`), if the folder has one, must equal it: Llama 3's rule, so that every layout computes the
    same model."""
    copies: dict[str, tuple[Copy, ...]] = {
        fqn: tuple(
            Copy(name, "torchpre's multi-token prediction shares the model's embedding and output layer")
            for layer in _mtp_layers(args)
            if (name := f"model.layers.{layer}.{copy}") in folder
        )
        for fqn, copy in _MTP_COPIES.items()
    }
    embedding = _TOP_LEVEL["tok_embeddings.weight"]
    if args.tie_word_embeddings and _TOP_LEVEL[_TIED] in folder:
        why = "the model ties them (tie_word_embeddings); these weights belong to a model with untied embeddings"
        copies["tok_embeddings.weight"] += (Copy(_TOP_LEVEL[_TIED], why),)
    by_name: dict[str, Source] = {}
    for fqn in _torchpre_shapes(args):
        if fqn == _MTP_EMBEDDING or (fqn == _TIED and args.tie_word_embeddings):
            by_name[fqn] = Same(embedding)
            continue
        names = _hf_names(fqn, args)
        if _is_experts(fqn):
            by_name[fqn] = StackedExperts(tuple(names))
        else:
            by_name[fqn] = Same(names[0], copies=copies.get(fqn, ()), zeros=_zero_bias(names[0], args, folder))
    last = args.n_layers + args.mtp_depth
    return Sources(by_name, frozenset(name for name in folder if _layer_of(name) >= last))


def _zero_bias(name: str, args: DeepSeekV3Args, folder: Collection[str]) -> tuple[Zeros, ...]:
    """For a router's weight in a model without bias balancing: the folder's routing bias of that layer, which
    transformers always saves, must be zeros (it would change which experts are chosen)."""
    bias = name.removesuffix("weight") + "e_score_correction_bias"
    if args.bias_update_rate or not name.endswith("mlp.gate.weight") or bias not in folder:
        return ()
    why = "the job's model has no balancing bias: set the model's bias_update_rate > 0 to import it"
    return (Zeros(bias, why),)


def _is_experts(fqn: str) -> bool:
    return ".".join(fqn.split(".")[-3:]) in _EXPERTS


def _layer_of(hf_name: str) -> int:
    """The layer index of a Hugging Face name (model.layers.{i}....), -1 outside the layers."""
    parts = hf_name.split(".")
    return int(parts[2]) if parts[:2] == ["model", "layers"] else -1


def _hf_names(fqn: str, args: DeepSeekV3Args) -> list[str]:
    """The Hugging Face names of a torchpre tensor: one, or one per routed expert for a stacked expert weight."""
    if fqn in _TOP_LEVEL:
        return [_TOP_LEVEL[fqn]]
    if fqn.startswith("mtp."):  # mtp.depths.{k}.{name}: layer n_layers + k - 1
        _, _, depth, name = fqn.split(".", 3)
        layer = args.n_layers + int(depth) - 1
        if name in _MTP:
            return [f"model.layers.{layer}.{_MTP[name]}"]
        name = name.removeprefix("block.")
    else:
        _, layer, name = fqn.split(".", 2)  # layers.{i}.{name}
    prefix = f"model.layers.{layer}"
    if name in _EXPERTS:
        return [f"{prefix}.mlp.experts.{e}.{_EXPERTS[name]}.weight" for e in range(args.num_experts)]
    return [f"{prefix}.{_PER_LAYER[name]}"]


def hf_config(
    args: DeepSeekV3Args,
    *,
    bos_token_id: int,
    eos_token_id: int,
    torch_dtype: str,
    max_position_embeddings: int | None = None,
) -> dict[str, Any]:
    """The `config.json` of a `DeepseekV3ForCausalLM` with these args (transformers 5.x keys), with
    `num_nextn_predict_layers` = mtp_depth. Raises TorchpreError for a shared expert that is not
    a whole number of routed experts wide (transformers sizes it as `n_shared_experts` of them)."""
    if args.shared_expert_hidden_dim == 0 or args.shared_expert_hidden_dim % args.moe_hidden_dim:
        raise TorchpreError(
            f"shared_expert_hidden_dim = {args.shared_expert_hidden_dim} is not a positive multiple of moe_hidden_dim "
            f"= {args.moe_hidden_dim}: a Hugging Face DeepSeek-V3 has n_shared_experts routed experts' width."
        )
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.yarn is not None:  # attention_factor and truncate only when set, as transformers writes them
        unset = {"attention_factor": None, "truncate": True}
        yarn = {key: value for key, value in vars(args.yarn).items() if unset.get(key, ...) != value}
        rope = {"rope_type": "yarn", "rope_theta": args.rope_theta, **yarn}
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": args.dim,
        "intermediate_size": args.dense_hidden_dim,
        "moe_intermediate_size": args.moe_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_heads,
        "n_shared_experts": args.shared_expert_hidden_dim // args.moe_hidden_dim,
        "n_routed_experts": args.num_experts,
        "num_experts_per_tok": args.top_k,
        "routed_scaling_factor": args.routed_scaling_factor,
        "n_group": args.n_group,
        "topk_group": args.topk_group,
        "norm_topk_prob": args.norm_topk_prob,
        "first_k_dense_replace": args.first_k_dense,
        "q_lora_rank": args.q_lora_rank or None,
        "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_parameters": rope,
        "rope_interleave": True,
        "max_position_embeddings": max_position_embeddings or args.max_seq_len,
        "tie_word_embeddings": args.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "num_nextn_predict_layers": args.mtp_depth,
        "torch_dtype": torch_dtype,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
    }


def args_from_hf_config(config: Mapping[str, Any]) -> DeepSeekV3Args:
    """The DeepSeekV3Args a Hugging Face DeepSeek-V3 `config.json` describes (transformers' defaults for missing
    keys), with bias balancing on at DeepSeek-V3's rate 1e-3 so that the folder's routing biases load. Every field is
    read or refused (`_READ`, `_FIXED`, `torchpre.models.hf_fields`): a TorchpreError names the first one this family
    cannot express. Kimi-K2's folders (model_type 'kimi_k2', DeepSeek-V3's architecture) read the same."""
    if config.get("model_type") not in _MODEL_TYPES:
        raise TorchpreError(f"model_type is {config.get('model_type')!r}; only 'deepseek_v3' configs can be converted.")
    check_fields(config, _READ, _FIXED, "deepseek_v3")
    check_divides(config, "n_group", "n_routed_experts", "the routed experts form n_group groups of equal size")
    heads = config.get("num_attention_heads", 128)
    qk_rope_head_dim, qk_nope_head_dim = config.get("qk_rope_head_dim", 64), config.get("qk_nope_head_dim", 128)
    derived = {
        "num_key_value_heads": heads,
        "head_dim": qk_rope_head_dim,
        "qk_head_dim": qk_nope_head_dim + qk_rope_head_dim,
    }
    for key, value in derived.items():
        if config.get(key) not in (None, value):
            raise TorchpreError(f"{key} = {config[key]} is not {value}, which the other fields make it in deepseek_v3.")
    rope_key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    rope = dict(config.get(rope_key) or {})
    context = config.get("max_position_embeddings", 4096)
    moe_hidden = config.get("moe_intermediate_size", 2048)
    return DeepSeekV3Args(
        dim=config.get("hidden_size", 7168),
        n_layers=config.get("num_hidden_layers", 61),
        n_heads=heads,
        vocab_size=config.get("vocab_size", 129280),
        max_seq_len=context,
        norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", config.get("rope_theta", 10000.0)),
        yarn=_yarn(rope, context, f"{rope_key}."),
        tie_word_embeddings=config.get("tie_word_embeddings", False),
        q_lora_rank=config.get("q_lora_rank", 1536) or 0,
        kv_lora_rank=config.get("kv_lora_rank", 512),
        qk_nope_head_dim=qk_nope_head_dim,
        qk_rope_head_dim=qk_rope_head_dim,
        v_head_dim=config.get("v_head_dim", 128),
        dense_hidden_dim=config.get("intermediate_size", 18432),
        num_experts=config.get("n_routed_experts", 256),
        top_k=config.get("num_experts_per_tok", 8),
        moe_hidden_dim=moe_hidden,
        shared_expert_hidden_dim=moe_hidden * config.get("n_shared_experts", 1),
        score_func="sigmoid",
        n_group=config.get("n_group", 8),
        topk_group=config.get("topk_group", 4),
        norm_topk_prob=config.get("norm_topk_prob", True),
        routed_scaling_factor=config.get("routed_scaling_factor", 2.5),
        aux_loss_coeff=config.get("aux_loss_alpha", 1e-4),
        bias_update_rate=1e-3,
        first_k_dense=config.get("first_k_dense_replace", 3),
    )


def _yarn(rope: Mapping[str, Any], context: int, prefix: str) -> YarnScaling | None:
    """The YaRN scaling of a config's RoPE fields (`prefix`: their object's key and a dot), read as transformers reads
    them (`_compute_yarn_parameters`): an absent factor is max_position_embeddings / original_max_position_embeddings,
    an absent mscale leaves the cos/sin scale at mscale(factor)."""
    check_kinds(rope, _ROPE_NAMES, prefix)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in _ROPE_READ:
        raise TorchpreError(f"rope_type = {rope_type!r} is not supported; deepseek_v3 has 'default' and 'yarn'.")
    check_fields(rope, _ROPE_READ[rope_type], {}, "deepseek_v3", prefix=prefix)
    if rope_type == "default":
        return None
    if "original_max_position_embeddings" not in rope:
        raise TorchpreError("the YaRN RoPE scaling lacks original_max_position_embeddings.")
    original = rope["original_max_position_embeddings"]
    return YarnScaling(
        factor=rope.get("factor") or context / original,
        original_max_position_embeddings=original,
        beta_fast=rope.get("beta_fast") or 32.0,
        beta_slow=rope.get("beta_slow") or 1.0,
        mscale=rope.get("mscale") or 0.0,
        mscale_all_dim=rope.get("mscale_all_dim") or 0.0,
        attention_factor=rope.get("attention_factor"),
        truncate=rope.get("truncate", True),
    )


def hf_config_mismatches(config: Mapping[str, Any], args: DeepSeekV3Args) -> list[str]:
    """Every field where a Hugging Face config disagrees with `args`, as 'key = theirs, but ours' lines; empty when
    its weights load into `DeepSeekV3Transformer(args)` and compute the same. max_position_embeddings is not
    compared: it does not change the weights."""
    theirs = args_from_hf_config(config)
    return [
        f"{field} = {getattr(theirs, field)!r} in the Hugging Face config, but the job's model has "
        f"{field} = {getattr(args, field)!r}"
        for field in _COMPARED_FIELDS
        if getattr(theirs, field) != getattr(args, field)
    ]


def _torchpre_shapes(args: DeepSeekV3Args) -> dict[str, torch.Size]:
    """FQN -> shape of every tensor in `DeepSeekV3Transformer(args).state_dict()`, built on the meta device."""
    with torch.device("meta"):
        return {fqn: t.shape for fqn, t in DeepSeekV3Transformer(args).state_dict().items()}
