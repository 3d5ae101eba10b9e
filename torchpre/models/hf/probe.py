"""An architecture checked on a tiny copy of it, before any work.

torchpre trains a transformers model through transformers' own forward, so what it must establish per
architecture is narrow, and it establishes it by running the model, not from a list of families:
- the model trains on token ids alone, deterministically (no dropout or noise), and torchpre's initialisation
  (`torchpre.models.hf.init`) gives it exactly the buffers transformers computes: `HFCausalLM`'s logits equal
  those of transformers' own model built from the config and given the same parameters, bit for bit;
- the role of each module around the decoder layers, read off the forward itself (`roles`): run before the
  layers and holding parameters (embeddings: the first pipeline stage), run before them with an output the
  layers take as it is (rotary tables: every stage), or run after them (final norm, output layer: the last);
- the decoder layers run as pipeline stages: two stages of one layer each reproduce the whole model's logits
  bit for bit;
- the forward can take a slice of the sequence between the layers (sequence parallelism): it hands the layers no
  attention-mask tensor (one would be built for the slice) and takes the positions from `position_ids`;
- every parameter gets a gradient: one that some inputs leave unused (Longcat's identity experts) would make
  ZeRO-3's per-block collectives differ between ranks.

The copy is `tiny_config(config)`: the same architecture and switches at tiny sizes. A probe costs well under
a second for most architectures and is made once per config.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from torchpre.errors import ConfigError
from torchpre.models.hf.args import ConfigKey, HFArgs
from torchpre.models.hf.init import init_weights
from torchpre.models.hf.model import HFCausalLM, meta_model, outside_blocks, split_stages
from torchpre.models.hf.tiny import tiny_config
from torchpre.optional import import_optional
from torchpre.parallel.pipeline import prune_to

if TYPE_CHECKING:
    from transformers import PretrainedConfig

BATCH, SEQ_LEN, SEED = 2, 8, 0


@dataclass(frozen=True)
class Probe:
    """What the tiny copy showed: why torchpre does not train the architecture at all (None: it does), why its
    layers do not run as pipeline stages (None: they do), and the roles of the modules around the layers."""

    refusal: str | None
    pipeline_refusal: str | None
    roles: dict[str, str]
    sequence_refusal: str | None = None
    fsdp_refusal: str | None = None


def probe(config: PretrainedConfig) -> Probe:
    """The probe of `config`'s architecture (made once per config)."""
    return _probe(ConfigKey(config))


@functools.lru_cache(maxsize=16)
def _probe(key: ConfigKey) -> Probe:
    try:
        model = tiny_model(key.config)
    except ConfigError as error:
        return Probe(refusal=str(error), pipeline_refusal=None, roles={})
    except Exception as error:  # noqa: BLE001 - transformers' own complaint about the config, reported by name
        return Probe(f"torchpre cannot build a tiny copy of it to check it on ({_brief(error)})", None, {})
    tokens = torch.randint(0, model.config.vocab_size, (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    try:
        logits, roles, masked = _run_recording_roles(model, tokens)
        refusal = _whole_model_refusal(model, tokens, logits)
    except Exception as error:  # noqa: BLE001
        return Probe(f"its forward and backward on token ids alone fail on a tiny copy ({_brief(error)})", None, {})
    if refusal is not None:
        return Probe(refusal, None, roles)
    pipeline = _pipeline_refusal(model, roles, tokens, logits)
    unused = [name for name, param in model.named_parameters() if param.grad is None]
    fsdp = f"its parameters {', '.join(unused[:3])} get no gradient from some inputs" if unused else None
    return Probe(None, pipeline, roles, _sequence_refusal(model, tokens, logits, masked), fsdp)


def tiny_model(config: PretrainedConfig) -> HFCausalLM:
    """`config`'s architecture at tiny sizes on the CPU, initialised (every buffer checked: NaN until set), in
    training mode."""
    tiny = tiny_config(config)
    tiny.use_cache = False
    with torch.device("meta"):
        model = HFCausalLM(HFArgs(config=tiny, path="", max_seq_len=SEQ_LEN))
    model.to_empty(device="cpu")
    for buffer in model.buffers():
        if buffer.is_floating_point():
            buffer.fill_(float("nan"))  # a buffer the initialisation misses shows in the logits
    init_weights(model, SEED)
    return model.train()


def _run_recording_roles(model: HFCausalLM, tokens: Tensor) -> tuple[Tensor, dict[str, str], bool]:
    """The logits of a forward (and its backward, which must run), each outside module's role in it, and whether
    the layers were handed an attention-mask tensor ([..., seq, seq])."""
    around = outside_blocks(model)
    calls: list[tuple[str, str, list[Tensor]]] = []  # (kind, name, tensors): "module" outputs, "layer" inputs
    handles = []
    for name in around:
        module = model.get_submodule(name)
        handles.append(module.register_forward_hook(_recorder(calls, "module", name, outputs=True)))
    for name, layer in model.get_submodule(model.blocks).named_children():
        handles.append(layer.register_forward_pre_hook(_recorder(calls, "layer", name), with_kwargs=True))
    try:
        logits = model(tokens)
        logits.float().square().mean().backward()
    finally:
        for handle in handles:
            handle.remove()
    seq = tokens.shape[1]
    masked = any(t.ndim >= 2 and t.shape[-2:] == (seq, seq) for kind, _, ts in calls if kind == "layer" for t in ts)
    return logits.detach(), _roles(model, around, calls), masked


def _recorder(calls: list, kind: str, name: str, outputs: bool = False):
    if outputs:
        return lambda module, args, output: calls.append((kind, name, list(_tensors(output))))
    return lambda module, args, kwargs: calls.append((kind, name, list(_tensors((args, kwargs)))))


def _roles(model: HFCausalLM, around: list[str], calls: list[tuple[str, str, list[Tensor]]]) -> dict[str, str]:
    first_layer = next((i for i, (kind, _, _) in enumerate(calls) if kind == "layer"), len(calls))
    layer_inputs = {id(t) for kind, _, ts in calls if kind == "layer" for t in ts}
    roles = {}
    for name in around:
        index, ids = next(((i, {id(t) for t in ts}) for i, (kind, n, ts) in enumerate(calls)
                           if n == name and kind == "module"), (None, set()))  # fmt: skip
        has_parameters = any(True for _ in model.get_submodule(name).parameters())
        if index is not None and index > first_layer:
            roles[name] = "last"
        elif not has_parameters and ids & layer_inputs:
            roles[name] = "every"
        else:
            roles[name] = "first"
    return roles


def _whole_model_refusal(model: HFCausalLM, tokens: Tensor, logits: Tensor) -> str | None:
    """Why HFCausalLM does not compute what transformers computes for this architecture (None: it does)."""
    transformers = import_optional("transformers", "model.name = 'hf'", extra="hf")
    reference = transformers.AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).train()
    missing, unexpected = reference.load_state_dict(model.state_dict(), strict=False)
    if unexpected or set(missing) - set(reference.all_tied_weights_keys):
        return f"its parameters are not transformers' own (missing {missing[:3]}, unexpected {unexpected[:3]})"
    with torch.no_grad():
        again = model(tokens)
        theirs = reference(input_ids=tokens, use_cache=False).logits
    if not torch.equal(again, logits):
        return "its forward is not deterministic (two runs on the same tokens differ), so no layout could match"
    if not torch.equal(theirs, logits):
        difference = (theirs - logits).abs().nan_to_num(float("inf")).max().item()
        return (
            f"torchpre's initialisation does not reproduce transformers' buffers for it (the logits differ from "
            f"transformers' by up to {difference:.3g} on a tiny copy)"
        )
    return None


def _pipeline_refusal(model: HFCausalLM, roles: dict[str, str], tokens: Tensor, logits: Tensor) -> str | None:
    """Why two pipeline stages do not reproduce the whole model on the tiny copy (None: they do)."""
    if len(model.get_submodule(model.blocks)) < 2:
        return "the tiny copy has fewer than two decoder layers to split"
    try:
        stages = [prune_to(model, names).train() for names in split_stages(model, roles, 2)]
        with torch.no_grad():
            hidden = tokens
            for stage in stages:
                hidden = stage(hidden)
    except Exception as error:  # noqa: BLE001
        return f"its decoder layers do not run as pipeline stages: {_brief(error)}"
    if hidden.shape != logits.shape or not torch.equal(hidden, logits):
        difference = (hidden - logits).abs().max().item() if hidden.shape == logits.shape else "shape"
        return (
            "two pipeline stages of it do not reproduce its forward (its forward does more than run the embeddings, "
            f"the layers and the head in turn; logits off by {difference} on a tiny copy)"
        )
    return None


def _sequence_refusal(model: HFCausalLM, tokens: Tensor, logits: Tensor, masked: bool) -> str | None:
    """Why the forward cannot take this rank's slice of the sequence between the layers (None: it can)."""
    if masked:
        return "its forward hands the layers an attention-mask tensor, which it would build for a slice of the sequence"
    positions = 2 * torch.arange(tokens.shape[1]).unsqueeze(0)  # other distances between tokens: logits must change
    try:
        with torch.no_grad():
            moved = model.causal_lm(input_ids=tokens, position_ids=positions, use_cache=False).logits
    except TypeError:
        return "its forward takes no position_ids"
    if torch.equal(moved, logits):
        return "its forward takes the positions from the length of its input, not from position_ids"
    return None


def _tensors(value: object) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _brief(error: Exception) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:200]}"


def decoder_stages(
    model: HFCausalLM, num_stages: int, split_points: Sequence[str] = (), **counts: int
) -> list[list[str]]:
    """The module names of each of `num_stages` pipeline stages of `model`: its decoder layers split in turn, the
    modules around them placed by their roles in its forward (see `split_stages`; `counts`: its embedding_layers and
    output_layers)."""
    return split_stages(model, probe(model.config).roles, num_stages, split_points, **counts)


def stage_modules(args: HFArgs, num_stages: int, split_points: Sequence[str], **counts: int) -> list[list[str]]:
    """`decoder_stages` of the model `args` describe (ModelSpec.parallel.stage_modules)."""
    return decoder_stages(meta_model(args), num_stages, split_points, **counts)
