"""Which layouts `model.name = "hf"` runs an architecture under, decided before any work.

Data parallel (ZeRO 0-2), activation checkpointing, torch.compile and bf16 need nothing of an architecture beyond
what the probe establishes (`torchpre.models.hf.probe`); ZeRO-3 (and HSDP) needs every parameter used by every
input; tensor parallel needs a plan for every module of
its layers (`parallelize`), sequence parallel a residual stream made of norms and parts that gather the sequence
(loss parallel is accepted with it: the support table trains them together), pipeline parallel stages that
reproduce its forward. A layout that is not established is refused with one message
that names the config, the architecture, the layout, why, and the layouts that do run it.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import TYPE_CHECKING

from torchpre.distributed.parallel_dims import ParallelDims
from torchpre.errors import ConfigError, resolve_step
from torchpre.models.hf.args import HFArgs
from torchpre.models.hf.model import HFCausalLM, meta_model, tied_weights
from torchpre.models.hf.parallelize import (
    divided_counts,
    sequence_parallel_refusal,
    sliding_window,
    tensor_parallel_plan,
    tensor_parallel_refusal,
)
from torchpre.models.hf.probe import probe
from torchpre.models.hf.tiny import is_stochastic_key

if TYPE_CHECKING:
    from transformers import PretrainedConfig

DATA, FSDP, TENSOR, PIPELINE = "data parallel", "ZeRO-3 (FSDP)", "tensor parallel", "pipeline parallel"
SEQUENCE = "sequence and loss parallel"  # checked together: the support table trains them together


def refusals(args: HFArgs, tp: int = 2) -> dict[str, str | None]:
    """Why each layout does not run the model of `args` exactly (None: it does); tensor parallel of degree `tp`."""
    found = probe(args.config)
    if found.refusal is not None:
        return dict.fromkeys((DATA, FSDP, TENSOR, SEQUENCE, PIPELINE), found.refusal)
    model = meta_model(args)
    tensor = tensor_parallel_refusal(model, tp)
    return {
        DATA: None,
        FSDP: found.fsdp_refusal,
        TENSOR: tensor,
        SEQUENCE: tensor or sequence_parallel_refusal(model, args.max_seq_len),
        PIPELINE: found.pipeline_refusal,
    }


def conditions(args: HFArgs, tp: int = 2, reasons: dict[str, str | None] | None = None) -> list[str]:
    """The config values that the layouts `refusals(args, tp)` runs depend on, each as the condition under which it
    runs them (start-up checks the job's own config and refuses a layout whose condition fails):
    - tensor parallel: the degree divides the head and expert counts (`divided_counts`);
    - sequence and loss parallel: a sliding window no shorter than training.seq_len;
    - a scalar key that the model's own forward reads around the layers (a multiplier, a scale, a softcap), where
      the checks refuse a layout once its value changes (they are run on the config with it halved, or at 0.5 for
      0): the layout runs with the value as given only.
    Empty when the architecture is refused under every layout. `reasons`: `refusals(args, tp)`, if at hand."""
    reasons = reasons or refusals(args, tp)
    if reasons[DATA] is not None:
        return []
    model = meta_model(args)
    found = []
    if reasons[TENSOR] is None and (counts := divided_counts(model, tensor_parallel_plan(model))):
        names = [" of ".join(reversed(key.split(" "))) for key in counts]  # "num_experts of model.layers.0..."
        found.append(f"{TENSOR}: its degree divides {', '.join(names)}")
    if reasons[SEQUENCE] is None and sliding_window(args.config) is not None:
        found.append(f"{SEQUENCE}: sliding_window >= training.seq_len")
    for key, value in _forward_scalars(model):
        other = value / 2 if value else 0.5
        changed = refusals(dataclasses.replace(args, config=_with(args.config, key, other)), tp)
        lost = [layout for layout, why in reasons.items() if why is None and changed[layout] is not None]
        if lost:
            where = "every layout" if DATA in lost else ", ".join(lost)
            found.append(f"{where}: {key} = {value!r} ({other!r} refused)")
    return found


def _forward_scalars(model: HFCausalLM) -> list[tuple[str, float]]:
    """The float keys of the model's config that the forward of its causal LM or of its decoder reads (by name in
    their source): what acts around the decoder layers, which pipeline stages and sequence slices take apart.
    Dropout-like keys are left out: any non-zero value is refused anyway."""
    owners = [model.causal_lm_class, type(model.get_submodule(model.decoder_path))]
    source = ""
    for owner in owners:
        try:
            source += inspect.getsource(owner.forward)
        except (OSError, TypeError):  # a forward without Python source (a container's)
            continue
    return [
        (key, value)
        for key, value in model.config.to_dict().items()
        if type(value) is float and not is_stochastic_key(key) and key in source
    ]


def _with(config: PretrainedConfig, key: str, value: object) -> PretrainedConfig:
    return type(config).from_dict({**config.to_dict(), key: value})


def validate_tensor_parallel(args: HFArgs, tp: int) -> None:
    """ModelSpec.parallel.validate_tensor_parallel: refuses tensor (and sequence, and loss) parallelism the model
    does not run."""
    reasons = refusals(args, tp)
    _refuse_if(args, DATA, reasons)
    _refuse_if(args, TENSOR, reasons)
    if args.sequence_parallel or args.loss_parallel:
        _refuse_if(args, SEQUENCE, reasons)


@resolve_step
def validate_layout(args: HFArgs, dims: ParallelDims) -> None:
    """ModelSpec.parallel.validate_layout: refuses an architecture torchpre does not train, ZeRO-3 of parameters some
    inputs leave unused, or pipeline stages that do not reproduce its forward."""
    reasons = refusals(args, max(dims.tp, 2))
    _refuse_if(args, DATA, reasons)
    if args.fsdp and dims.dp > 1:
        _refuse_if(args, FSDP, reasons)
    if dims.pp > 1:
        _refuse_if(args, PIPELINE, reasons)
    tied_weights(args)  # more than one tied weight is refused here, before any work


def _refuse_if(args: HFArgs, layout: str, reasons: dict[str, str | None]) -> None:
    why = reasons[layout]
    if why is None:
        return
    architecture = f"{meta_model(args).architecture} (model_type '{args.config.model_type}')"
    if layout == DATA:
        raise ConfigError(f"model.hf_config = {args.path}: {architecture} is refused under every layout: {why}.")
    works = [name for name, reason in reasons.items() if reason is None]
    raise ConfigError(
        f"model.hf_config = {args.path}: {architecture} under {layout}: refused: {why}. It trains under "
        f"{', '.join(works)} (docs/hf-models.md lists every architecture's layouts)."
    )
