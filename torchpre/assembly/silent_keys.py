"""Keys a user sets expecting an effect that this job would give them none: refused at start-up, naming the key.

Each check here is of a value that is valid on its own but does nothing in this job: a quantize setting without a
low-precision format, multi-token prediction deeper than a sequence, a resume step without resuming, FSDP units per
sub-layer for a family that names none, a pattern that
matches no module or parameter of the model (read on the model built on the meta device, only when a pattern is
set). Left alone, each would train a different run than the one asked for, without a word.
"""

import fnmatch
from collections.abc import Sequence

from torch import nn

from torchpre.assembly.meta import meta_model
from torchpre.config.job_config import JobConfig, Quantize
from torchpre.errors import ConfigError, resolve_step
from torchpre.models.args import ModelArgs
from torchpre.models.registry import ModelSpec


@resolve_step
def check_keys_take_effect(config: JobConfig, spec: ModelSpec, args: ModelArgs, shortest_seq_len: int) -> None:
    """Refuses the first key that would do nothing; `shortest_seq_len` is the shortest of the run's data stages."""
    _check_quantize_format(config.quantize)
    if config.hf_export.enable and spec.hf is None:
        raise ConfigError(
            f"hf_export.enable: model.name = '{config.model.name}' has no Hugging Face conversion (its ModelSpec has "
            "no `hf` adapter). Turn hf_export off, or export checkpoints another way."
        )
    c = config.checkpoint
    if c.load_step != -1 and not c.enable:
        raise ConfigError(
            f"checkpoint.load_step = {c.load_step} with checkpoint.enable off: a job resumes only with checkpoints "
            "on, so this one would train from step 0. Set checkpoint.enable = true to resume that step, or leave "
            "checkpoint.load_step at -1 (checkpoint.initial_load_path loads weights into a new run)."
        )
    if config.parallelism.fsdp_wrap == "sublayer" and not spec.build.sublayers:
        raise ConfigError(
            f"parallelism.fsdp_wrap = 'sublayer': model.name = '{config.model.name}' names no sub-layers for FSDP "
            "(its ModelBuild.sublayers is empty), so every block would stay one unit. Use parallelism.fsdp_wrap = "
            "'block', or name the family's sub-layers."
        )
    depth = args.mtp_depth
    if depth >= shortest_seq_len:
        raise ConfigError(
            f"model.mtp_depth = {depth} predicts up to {depth + 1} tokens past each position, but the sequences of "
            f"{shortest_seq_len} tokens (training.seq_len, or a data stage's) leave its deepest prediction no "
            f"target. Use model.mtp_depth < {shortest_seq_len}."
        )
    q, o = config.quantize, config.optimizer
    patterns = {"quantize.modules": list(q.modules) if q.linear != "none" else []}
    patterns["optimizer.muon_adamw_params"] = list(o.muon_adamw_params)
    if any(patterns.values()):
        model = meta_model(config, spec, args)
        linears = [name for name, module in model.named_modules() if type(module) is nn.Linear]
        _check_patterns("quantize.modules", patterns["quantize.modules"], linears, "linear")
        parameters = [name for name, _ in model.named_parameters()]
        _check_patterns("optimizer.muon_adamw_params", patterns["optimizer.muon_adamw_params"], parameters, "parameter")


def _check_quantize_format(q: Quantize) -> None:
    """The quantize keys but `linear` configure a low-precision format: without one they do nothing."""
    if q.linear != "none":
        return
    unset = Quantize()
    changed = [name for name in ("recipe", "modules", "emulate") if getattr(q, name) != getattr(unset, name)]
    if changed:
        keys = " and ".join(f"quantize.{name} = {getattr(q, name)!r}" for name in changed)
        raise ConfigError(
            f"{keys} with quantize.linear = 'none': they configure low-precision linears, and none are chosen, so "
            "the run would train in full precision. Set quantize.linear = 'float8' or 'mxfp8', or leave them at "
            "their defaults."
        )


def _check_patterns(key: str, patterns: Sequence[str], names: Sequence[str], kind: str) -> None:
    """Each fnmatch pattern of `key` must match one of the model's `names` (of `kind`s)."""
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            examples = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
            raise ConfigError(
                f"{key}: the pattern '{pattern}' matches no {kind} of the model (fnmatch against full names such as "
                f"{examples}). Fix the pattern, or remove it."
            )
