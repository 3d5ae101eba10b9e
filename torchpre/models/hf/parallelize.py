"""Tensor parallelism (+ sequence parallel, + loss parallel) for transformers decoders, derived from their modules.

Each decoder layer is read module by module against a small table of structures, by the names transformers gives
them; a layer whose attention or feed-forward matches none is refused by name. What each structure gets:
- attention with separate q/k/v projections and an output projection, and at most per-head q/k norms: whole heads
  per rank ("heads": q/k/v column-parallel, the output row-parallel; the attention runs on the rank's heads, its
  head-count attributes divided by the degree; a per-head norm's weight gradient is summed over the ranks), if
  its forward runs on a rank's heads: checked on the tiny copy by running each rank's share of heads and adding
  the shares (an attention that reshapes to the whole width, as XGLM's does, takes "gathered" instead);
- any other attention whose projections are known (fused q/k/v as in Phi-3, GPT-2 or GPT-NeoX, full-width q/k norms
  as in OLMo2, output gates or sinks): "gathered": each rank computes its share of the input projections' columns,
  the columns are gathered, the attention runs whole on every rank, and the output projection is row-parallel;
- a feed-forward of an input and an output projection (gate/up/down, fc1/fc2, c_fc/c_proj, dense_h_to_4h/...):
  whole neurons per rank ("neurons"), or "gathered" when something with parameters sits between them (a fused
  gate/up projection, a norm over the hidden width);
- the experts of a Mixture of Experts: whole experts per rank ("experts", see `styles.ExpertShards`); routers and
  gates stay replicated, shared experts are feed-forwards as above;
- norms stay replicated (sequence-parallel under SP); GPT-2's Conv1D takes the transposed styles of `styles`.
Anything else that holds parameters in a layer (a state-space mixer, MLA's low-rank projections) has no rule.
Every replicated module sees replicated activations, so the plan is exact; the support table checks it per
architecture against one process (docs/hf-models.md).
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, SequenceParallel

from torchpre.errors import ConfigError
from torchpre.models.hf.args import ConfigKey
from torchpre.models.hf.model import HFCausalLM
from torchpre.models.hf.probe import probe, tiny_model
from torchpre.models.hf.styles import (
    Conv1DColwise,
    Conv1DRowwise,
    ExpertShards,
    GatherSequence,
    RowwiseOutputParallel,
    VocabParallelEmbedding,
)
from torchpre.parallel.tensor_parallel import apply_tensor_parallel

if TYPE_CHECKING:
    from transformers import PretrainedConfig

QKV = ("q_proj", "k_proj", "v_proj")
FUSED_QKV = ("qkv_proj", "query_key_value", "c_attn", "Wqkv")
ATTENTION_OUTPUTS = ("o_proj", "out_proj", "dense", "c_proj")
HEAD_NORMS = ("q_norm", "k_norm", "q_layernorm", "k_layernorm", "query_layernorm", "key_layernorm")
FEED_FORWARDS = (  # (input projections, output projection)
    (("gate_proj", "up_proj"), "down_proj"),
    (("gate_up_proj",), "down_proj"),
    (("up_proj",), "down_proj"),
    (("w1", "w3"), "w2"),
    (("fc1",), "fc2"),
    (("c_fc",), "c_proj"),
    (("dense_h_to_4h",), "dense_4h_to_h"),
    (("fc_in",), "fc_out"),
)
HEAD_COUNTS = re.compile(r"^(num|n)_(heads|head|attention_heads|key_value_heads|kv_heads)$")
# What a transformers attention returns: its output, or a tuple it leads (the attention weights, or None, follow).
AttentionOutput = Union[Tensor, tuple[Tensor, ...]]


class Unplanned(ConfigError):
    """A module of a decoder layer that no tensor-parallel rule covers."""


@dataclass
class Plan:
    """The tensor-parallel styles of a model by module path, what kind each layer's parts got, and the attention
    modules whose head-count attributes become per-rank counts."""

    residual: Placement = Replicate()  # of the hidden states between a layer's parts: Shard(1) under SP
    gathered: frozenset[str] = frozenset()  # attention classes that do not run on a rank's heads
    styles: dict[str, ParallelStyle] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)  # module path -> "heads" | "gathered" | "neurons" | "experts"
    head_attention: list[str] = field(default_factory=list)
    experts: list[str] = field(default_factory=list)
    norms: list[str] = field(default_factory=list)  # the layers' own norms (on the residual stream)


def tensor_parallel_plan(model: HFCausalLM, sequence_parallel: bool = False) -> Plan:
    """The plan of the decoder layers of `model` (a whole model or a pipeline stage), by structure. Raises
    Unplanned naming the first module no rule covers."""
    return _structural_plan(model, sequence_parallel, gathered=_attention_without_whole_heads(model.config))


def _structural_plan(model: HFCausalLM, sequence_parallel: bool, gathered: frozenset[str] = frozenset()) -> Plan:
    """The plan read off the modules, with the attention classes in `gathered` taking "gathered" for "heads"."""
    plan = Plan(residual=Shard(1) if sequence_parallel else Replicate(), gathered=gathered)
    for index, layer in model.get_submodule(model.blocks).named_children():
        if layer is not None:
            _plan_module(layer, f"{model.blocks}.{index}", plan, top=True)
    return plan


@functools.lru_cache(maxsize=16)
def _attention_cache(key: ConfigKey) -> frozenset[str]:
    model = tiny_model(key.config)
    plan = _structural_plan(model, sequence_parallel=False)
    calls: dict[str, tuple[tuple, dict, Tensor]] = {}

    def record(path: str, module: nn.Module, args: tuple, kwargs: dict, output: AttentionOutput) -> None:
        calls[path] = (args, kwargs, _first(output))

    handles = [
        model.get_submodule(path).register_forward_hook(functools.partial(record, path), with_kwargs=True)
        for path in plan.head_attention
    ]
    with torch.no_grad():
        model(torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0)))
    for handle in handles:
        handle.remove()
    return frozenset(
        type(model.get_submodule(path)).__name__
        for path, (args, kwargs, output) in calls.items()
        if not _whole_heads_add_up(model.get_submodule(path), args, kwargs, output)
    )


def _attention_without_whole_heads(config: PretrainedConfig) -> frozenset[str]:
    """The attention classes of `config`'s architecture whose forward does not run on a rank's share of the heads:
    on the tiny copy, each of two ranks' heads (q/k/v rows, output columns, head counts halved) must run, and
    their outputs must add up to the whole attention's."""
    return _attention_cache(ConfigKey(config))


def _whole_heads_add_up(attention: nn.Module, args: tuple, kwargs: dict, output: Tensor, tp: int = 2) -> bool:
    outputs = []
    for rank in range(tp):
        shard = copy.deepcopy(attention)
        for name, child in shard.named_children():
            if name in QKV:
                for param in child.parameters():
                    param.data = param.data.chunk(tp, dim=0)[rank]
            elif name in ATTENTION_OUTPUTS:
                child.weight.data = child.weight.data.chunk(tp, dim=1)[rank]
                if child.bias is not None and rank > 0:
                    child.bias.data.zero_()
        _per_rank_head_counts(shard, tp)
        try:
            with torch.no_grad():
                outputs.append(_first(shard(*args, **kwargs)))
        except (RuntimeError, ValueError, IndexError):
            return False
    total = torch.stack(outputs).sum(0)
    return total.shape == output.shape and torch.allclose(total, output, rtol=0, atol=1e-5)


def _first(output: AttentionOutput) -> Tensor:
    return output[0] if isinstance(output, tuple) else output


def _plan_module(module: nn.Module, path: str, plan: Plan, top: bool = False) -> None:
    children = {name: child for name, child in module.named_children() if _has_parameters(child)}
    if _is_experts(module):
        plan.styles[path] = ExpertShards()
        plan.kinds[path] = "experts"
        plan.experts.append(path)
        return
    output = next((name for name in ATTENTION_OUTPUTS if name in children), None)
    inputs = [name for name in (*QKV, *FUSED_QKV) if name in children]
    if output is not None and (set(QKV) <= set(inputs) or any(name in FUSED_QKV for name in inputs)):
        _plan_attention(module, path, children, inputs, output, plan)
        return
    for ins, out in FEED_FORWARDS:
        if set(ins) <= children.keys() and out in children:
            extra = [name for name in children if name not in (*ins, out)]
            fused = ins == ("gate_up_proj",)
            kind = "gathered" if fused or (extra and not top) else "neurons"
            _plan_projections(module, path, ins, out, kind, plan)
            for name in ins + (out,):
                children.pop(name)
            if not top:
                for name in extra:
                    children.pop(name)  # between the projections: replicated, on the gathered activations
            break
    for name, child in children.items():
        child_path = f"{path}.{name}"
        if _is_norm(child) or (not top and _is_router(child, module)):
            if top:
                plan.norms.append(child_path)
            continue  # replicated
        before = len(plan.kinds)
        _plan_module(child, child_path, plan)
        if len(plan.kinds) == before:
            raise Unplanned(f"{child_path} ({type(child).__name__}) has no tensor-parallel rule")


def _plan_attention(
    module: nn.Module, path: str, children: dict[str, nn.Module], inputs: list[str], output: str, plan: Plan
) -> None:
    extra = [name for name in children if name not in (*inputs, output)]
    head_dim = getattr(module, "head_dim", None)
    per_head = all(name in HEAD_NORMS and _norm_size(children[name]) == head_dim for name in extra)
    own = any(True for _ in module.parameters(recurse=False))  # sinks, differential-attention lambdas, ...
    runs_on_heads = type(module).__name__ not in plan.gathered
    kind = "heads" if set(inputs) == set(QKV) and per_head and not own and runs_on_heads else "gathered"
    _plan_projections(module, path, tuple(inputs), output, kind, plan)
    if kind == "heads":
        plan.head_attention.append(path)
        for name in extra:
            # A per-head norm's input is this rank's heads: the shards of any dimension its weight is broadcast
            # over make its weight gradient a partial sum, which DTensor then adds over the ranks. The batch
            # dimension (0) is one, wherever the model puts the heads.
            plan.styles[f"{path}.{name}"] = SequenceParallel(sequence_dim=0, use_local_output=True)


def _plan_projections(module: nn.Module, path: str, inputs: tuple, output: str, kind: str, plan: Plan) -> None:
    """Input projections column-parallel and the output projection row-parallel; `gathered`: the input
    projections' columns gathered, the output projection taking a replicated input."""
    gathered = kind == "gathered"
    for name in inputs:
        conv = _is_conv1d(module.get_submodule(name))
        column = Conv1DColwise if conv else ColwiseParallel
        plan.styles[f"{path}.{name}"] = column(output_layouts=Replicate()) if gathered else column()
    row = Conv1DRowwise if _is_conv1d(module.get_submodule(output)) else RowwiseOutputParallel
    inputs_layout = Replicate() if gathered else Shard(-1)
    plan.styles[f"{path}.{output}"] = row(input_layouts=inputs_layout, output_layouts=plan.residual)
    plan.kinds[path] = kind


def _has_parameters(module: nn.Module | None) -> bool:
    return module is not None and any(True for _ in module.parameters())


def _is_norm(module: nn.Module) -> bool:
    return all(param.ndim == 1 for param in module.parameters()) and (
        "norm" in type(module).__name__.lower() or not any(True for _ in module.children())
    )


def _norm_size(module: nn.Module) -> int | None:
    weight = getattr(module, "weight", None)
    return weight.shape[0] if weight is not None and _is_norm(module) else None


def _is_conv1d(module: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2): a linear layer with the weight stored [in, out]."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _is_experts(module: nn.Module) -> bool:
    """transformers' experts modules: `num_experts` weights stacked on dimension 0 of each 3-D parameter, run by
    `forward(hidden_states, top_k_index, top_k_weights)` (the convention `styles.ExpertShards` relies on)."""
    experts = getattr(module, "num_experts", None)
    params = list(module.parameters(recurse=False))
    signature = tuple(inspect.signature(inspect.unwrap(type(module).forward)).parameters)
    return (
        isinstance(experts, int)
        and signature == ("self", "hidden_states", "top_k_index", "top_k_weights")
        and bool(params)
        and all(p.ndim == 3 and p.shape[0] == experts for p in params)
    )


def _is_router(module: nn.Module, block: nn.Module) -> bool:
    """A router or gate of a Mixture of Experts block: it scores the block's (replicated) input per expert, or
    gates a shared expert with one value."""
    experts = next((m.num_experts for m in block.children() if _is_experts(m)), None)
    weights = [p for p in module.parameters() if p.ndim == 2]
    return experts is not None and bool(weights) and all(w.shape[0] in (experts, 1) for w in weights)


def divided_counts(model: HFCausalLM, plan: Plan) -> dict[str, int]:
    """The head and expert counts of `model` that a tensor-parallel degree must divide under `plan` (each rank holds
    whole heads and experts), by the config key that sets them."""
    counts = {f"{path} num_experts": model.get_submodule(path).num_experts for path in plan.experts[:1]}
    if plan.head_attention:
        heads = model.config.num_attention_heads
        kv_heads = getattr(model.config, "num_key_value_heads", None) or heads
        counts |= {"num_attention_heads": heads, "num_key_value_heads": kv_heads}
    return counts


def tensor_parallel_refusal(model: HFCausalLM, tp: int) -> str | None:
    """Why tensor parallelism of degree `tp` would not run `model` exactly (None: it runs it): a module without a
    rule, or a head or expert count `tp` does not divide."""
    try:
        plan = tensor_parallel_plan(model)
    except Unplanned as error:
        return str(error)
    counts = divided_counts(model, plan)
    for key, count in counts.items():
        if count % tp:
            common = math.gcd(*counts.values())
            degrees = ", ".join(str(d) for d in range(1, common + 1) if common % d == 0)
            return (
                f"{key} = {count} is not divisible by parallelism.tensor_parallel_degree = {tp} (each rank holds whole "
                f"heads and experts; degrees that divide {', '.join(counts)}: {degrees})"
            )
    return None


def apply_tensor_parallel_plan(
    model: HFCausalLM, tp_mesh: DeviceMesh, *, sequence_parallel: bool, loss_parallel: bool
) -> None:
    """Shards `model` (the whole model or a pipeline stage, on the meta device) in place over `tp_mesh`: its layers
    by `tensor_parallel_plan`, the input embedding vocabulary-parallel, the output layer column-parallel (its
    logits gathered, or left sharded over the vocabulary for loss parallel)."""
    plan = tensor_parallel_plan(model, sequence_parallel)
    styles: dict[str, ParallelStyle] = dict(plan.styles)
    if model.holds(model.input_embedding):
        styles[model.input_embedding] = VocabParallelEmbedding(input_layouts=Replicate(), output_layouts=plan.residual)
    if model.holds(model.output_layer):
        styles[model.output_layer] = ColwiseParallel(
            input_layouts=plan.residual,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if sequence_parallel:
        styles |= {path: GatherSequence() for path in plan.kinds}
        # Norms return local tensors: the layer adds them to residuals and to its parts' local outputs.
        norms = [*plan.norms, *_after_layers(model)]
        styles |= {path: SequenceParallel(use_local_output=True) for path in norms}
    apply_tensor_parallel(model, tp_mesh, styles)
    for path in plan.head_attention:
        _per_rank_head_counts(model.get_submodule(path), tp_mesh.size())
    model.sequence_shards = tp_mesh.size() if sequence_parallel else 1


def _after_layers(model: HFCausalLM) -> list[str]:
    """The modules with parameters this part holds that run after the decoder layers, but the output layer (the
    final norm)."""
    roles = probe(model.config).roles
    return [
        name
        for name, role in roles.items()
        if role == "last" and model.holds(name) and name != model.output_layer
        and _has_parameters(model.get_submodule(name))
    ]


def _per_rank_head_counts(attention: nn.Module, tp: int) -> None:
    """The attention of whole heads runs on this rank's heads: the head counts it keeps become per-rank counts."""
    for name, value in vars(attention).items():
        if HEAD_COUNTS.match(name) and isinstance(value, int):
            setattr(attention, name, value // tp)


def sliding_window(config: PretrainedConfig) -> int | None:
    """The config's sliding attention window, if it has one: a slice of the sequence cannot apply it."""
    window = getattr(config, "sliding_window", None)
    return window if isinstance(window, int) and not isinstance(window, bool) else None


def sequence_parallel_refusal(model: HFCausalLM, seq_len: int) -> str | None:
    """Why sequence parallelism would not run `model` exactly (None: it runs it): the hidden states between the
    layers' parts are this rank's slice of the sequence, so every module with parameters on the residual stream
    must be a norm (without submodules) or a part (attention, feed-forward) that gathers the sequence, the
    forward must build no mask tensor for the slice and take positions from `position_ids` (the probe), and
    nothing but the token embedding may act on the hidden states before the layers (a position-embedding table
    would add the whole sequence's positions to a slice)."""
    try:
        plan = tensor_parallel_plan(model, sequence_parallel=True)
    except Unplanned as error:
        return str(error)
    if plan.experts:
        return "its experts reduce a replicated output, not a sequence slice"
    layers = {f"{model.blocks}.{index}" for index, _ in model.get_submodule(model.blocks).named_children()}
    inside = [path for path in plan.kinds if path.rpartition(".")[0] not in layers]
    if inside:
        return f"{inside[0]} is not a part of its own in the layer, to gather the sequence for"
    window = sliding_window(model.config)
    if window is not None and window < seq_len:
        return f"its sliding window ({window}) is shorter than training.seq_len = {seq_len}: it masks each slice"
    after = [name for name in _after_layers(model) if not _is_norm(model.get_submodule(name))]
    if after:
        return f"{after[0]} acts on the hidden states after the layers"
    nested = [path for path in [*plan.norms, *_after_layers(model)] if len(model.get_submodule(path)._modules)]
    if nested:
        return f"{nested[0]} is a norm with submodules"
    found = probe(model.config)
    roles = found.roles
    before = [name for name, role in roles.items() if role == "first" and name != model.input_embedding
              and not isinstance(model.get_submodule(name), nn.Dropout)]  # fmt: skip
    if before:
        return f"{before[0]} acts on the hidden states before the layers"
    return found.sequence_refusal
