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

from torchpre.distributed.parallel_dims import ParallelDims
from torchpre.errors import ConfigError
from torchpre.models.hf.args import HFArgs
from torchpre.models.hf.model import meta_model, tied_weights
from torchpre.models.hf.parallelize import sequence_parallel_refusal, tensor_parallel_refusal
from torchpre.models.hf.probe import probe

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


def validate_tensor_parallel(args: HFArgs, tp: int) -> None:
    """ModelSpec.validate_tensor_parallel: refuses tensor (and sequence, and loss) parallelism the model does not
    run."""
    reasons = refusals(args, tp)
    _refuse_if(args, DATA, reasons)
    _refuse_if(args, TENSOR, reasons)
    if args.sequence_parallel or args.loss_parallel:
        _refuse_if(args, SEQUENCE, reasons)


def validate_layout(args: HFArgs, dims: ParallelDims) -> None:
    """ModelSpec.validate_layout: refuses an architecture torchpre does not train, ZeRO-3 of parameters some inputs
    leave unused, or pipeline stages that do not reproduce its forward."""
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
