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
  bit for bit.

The copy is `tiny_config(config)`: the same architecture and switches at tiny sizes. A probe costs well under
a second for most architectures and is made once per config.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from torchpre.errors import ConfigError
from torchpre.models.hf.args import ConfigKey, HFArgs
from torchpre.models.hf.init import init_weights
from torchpre.models.hf.model import HFCausalLM, meta_model, outside_blocks, split_stages
from torchpre.models.hf.tiny import tiny_config
from torchpre.optional import import_optional
from torchpre.parallel.pipeline import prune_to

BATCH, SEQ_LEN, SEED = 2, 8, 0


@dataclass(frozen=True)
class Probe:
    """What the tiny copy showed: why torchpre does not train the architecture at all (None: it does), why its
    layers do not run as pipeline stages (None: they do), and the roles of the modules around the layers."""

    refusal: str | None
    pipeline_refusal: str | None
    roles: dict[str, str]


def probe(config: Any) -> Probe:
    """The probe of `config`'s architecture (made once per config)."""
    return _probe(ConfigKey(config))


@functools.lru_cache(maxsize=16)
def _probe(key: ConfigKey) -> Probe:
    try:
        model = _tiny_model(key.config)
    except ConfigError as error:
        return Probe(refusal=str(error), pipeline_refusal=None, roles={})
    except Exception as error:  # noqa: BLE001 - transformers' own complaint about the config, reported by name
        return Probe(f"torchpre cannot build a tiny copy of it to check it on ({_brief(error)})", None, {})
    tokens = torch.randint(0, model.config.vocab_size, (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    try:
        logits, roles = _run_recording_roles(model, tokens)
        refusal = _whole_model_refusal(model, tokens, logits)
    except Exception as error:  # noqa: BLE001
        return Probe(f"its forward and backward on token ids alone fail on a tiny copy ({_brief(error)})", None, {})
    if refusal is not None:
        return Probe(refusal, None, roles)
    return Probe(None, _pipeline_refusal(model, roles, tokens, logits), roles)


def _tiny_model(config: Any) -> HFCausalLM:
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


def _run_recording_roles(model: HFCausalLM, tokens: Tensor) -> tuple[Tensor, dict[str, str]]:
    """The logits of a forward (and its backward, which must run) and each outside module's role in it."""
    around = outside_blocks(model)
    calls: list[tuple[str, str, set[int]]] = []  # (kind, name, tensor ids): "module" outputs, "layer" inputs
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
    return logits.detach(), _roles(model, around, calls)


def _recorder(calls: list, kind: str, name: str, outputs: bool = False):
    if outputs:
        return lambda module, args, output: calls.append((kind, name, _tensor_ids(output)))
    return lambda module, args, kwargs: calls.append((kind, name, _tensor_ids((args, kwargs))))


def _roles(model: HFCausalLM, around: list[str], calls: list[tuple[str, str, set[int]]]) -> dict[str, str]:
    first_layer = next((i for i, (kind, _, _) in enumerate(calls) if kind == "layer"), len(calls))
    layer_inputs = set().union(*(ids for kind, _, ids in calls if kind == "layer"))
    roles = {}
    for name in around:
        index, ids = next(((i, ids) for i, (kind, n, ids) in enumerate(calls) if n == name and kind == "module"),
                          (None, set()))  # fmt: skip
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


def _tensor_ids(value: Any) -> set[int]:
    return {id(tensor) for tensor in _tensors(value)}


def _tensors(value: Any) -> Iterator[Tensor]:
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


def decoder_stages(model: HFCausalLM, num_stages: int, split_points: Sequence[str] = ()) -> list[list[str]]:
    """The module names of each of `num_stages` pipeline stages of `model`: its decoder layers split in turn, the
    modules around them placed by their roles in its forward (see `split_stages`)."""
    return split_stages(model, probe(model.config).roles, num_stages, split_points)


def stage_modules(args: HFArgs, num_stages: int, split_points: Sequence[str]) -> list[list[str]]:
    """`decoder_stages` of the model `args` describe (ModelSpec.stage_modules)."""
    return decoder_stages(meta_model(args), num_stages, split_points)
