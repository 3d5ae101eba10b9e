"""The global batch of a job: how many sequences an optimizer step sees, and how many microbatches each
data-parallel rank accumulates for it; a resumed job keeps the batch its checkpoint was trained with."""

import logging
from pathlib import Path

from torchpre.checkpoint.integrity import Trust
from torchpre.checkpoint.state import read_train_values
from torchpre.config.job_config import JobConfig
from torchpre.distributed.elastic import world_sizes_hint
from torchpre.errors import ConfigError, resolve_step
from torchpre.step_rules.batch import BatchSizes

logger = logging.getLogger("torchpre")


def resolve_batch_sizes(local_batch_size: int, global_batch_size: int, dp: int) -> tuple[int, int]:
    """(global batch size, gradient-accumulation steps) for `training.global_batch_size`."""
    per_round = local_batch_size * dp
    if global_batch_size == -1:
        return per_round, 1
    if global_batch_size % per_round:
        raise ConfigError(
            f"training.global_batch_size = {global_batch_size} is not divisible by training.local_batch_size x "
            f"data-parallel degree = {local_batch_size} x {dp} = {per_round}. Use a multiple of {per_round} "
            "(or -1 for exactly one microbatch per rank)."
        )
    return global_batch_size, global_batch_size // per_round


@resolve_step
def batch_sizes(config: JobConfig, dp: int, resume_dir: Path | None, trust: Trust) -> BatchSizes:
    """`resolve_batch_sizes` for this job, except that a resumed job keeps the global batch its checkpoint
    (`resume_dir`, read as `trust` allows) was trained with when training.global_batch_size is -1 (derived): under
    another layout -1 would derive another batch and silently change the run. On other sequences it keeps their
    number or their tokens (training.global_batch_unit, `kept_global_batch`). An explicit value wins and is logged as
    a change."""
    t = config.training
    allow_pickle = config.checkpoint.allow_pickle
    saved, saved_seq_len = saved_batch(resume_dir, trust, allow_pickle) if resume_dir is not None else (0, 0)
    kept = kept_global_batch(saved, saved_seq_len or t.seq_len, t.seq_len, t.global_batch_unit)
    if saved and kept is None:
        raise ConfigError(
            f"{resume_dir} was trained with {_tokens(saved, saved_seq_len)}, which training.global_batch_unit = "
            f"'tokens' keeps, but that is no whole number of training.seq_len = {t.seq_len}-token sequences. Choose "
            f"a seq_len that divides {saved * saved_seq_len}, or set global_batch_unit = 'sequences' (or "
            "training.global_batch_size) to choose the global batch in sequences."
        )
    if saved and t.global_batch_size == -1:
        global_batch_size, accumulation = _keep_saved_batch(config, saved, saved_seq_len, kept, dp, resume_dir)
    else:
        if saved and t.global_batch_size != kept:
            _check_explicit_batch(config, saved, saved_seq_len, kept, resume_dir)
            logger.info(
                "training.global_batch_size changes from %d (the checkpoint's) to %d at step %s",
                kept, t.global_batch_size, resume_dir.name,
            )
        global_batch_size, accumulation = _resolve(config, t.global_batch_size, dp)
    return BatchSizes(global_batch_size, accumulation, t.local_batch_size, t.seq_len)


def kept_global_batch(saved: int, saved_seq_len: int, seq_len: int, unit: str) -> int | None:
    """The global batch in sequences that keeps a checkpoint's `saved` sequences of `saved_seq_len` tokens on
    `seq_len`-token ones: as many sequences (unit 'sequences'), or as many tokens (unit 'tokens'; None when they
    are no whole number of sequences)."""
    if unit == "sequences" or seq_len == saved_seq_len:
        return saved
    tokens = saved * saved_seq_len
    return None if tokens % seq_len else tokens // seq_len


def _tokens(sequences: int, seq_len: int) -> str:
    return f"a global batch of {sequences} sequences x {seq_len} tokens = {sequences * seq_len} tokens per step"


def _keeps(config: JobConfig, saved: int, saved_seq_len: int, kept: int) -> str:
    """What training.global_batch_unit keeps of the checkpoint's batch, in words."""
    t = config.training
    if kept == saved and saved_seq_len in (0, t.seq_len):
        return f"a global batch of {saved} sequences, which training.global_batch_size = -1 keeps on a resume"
    if t.global_batch_unit == "sequences":
        return f"{_tokens(saved, saved_seq_len)}, which training.global_batch_unit = 'sequences' keeps as {kept}"
    return (
        f"{_tokens(saved, saved_seq_len)}, which training.global_batch_unit = 'tokens' keeps at training.seq_len = "
        f"{t.seq_len} as {kept} sequences"
    )


def _keep_saved_batch(
    config: JobConfig, saved: int, saved_seq_len: int, kept: int, dp: int, resume_dir: Path
) -> tuple[int, int]:
    local = config.training.local_batch_size
    per_round = local * dp
    if kept % per_round:
        raise ConfigError(
            f"{resume_dir} was trained with {_keeps(config, saved, saved_seq_len, kept)}, but that is not divisible "
            f"by training.local_batch_size x data-parallel degree = {local} x {dp} = {per_round}. "
            f"Choose a local_batch_size that makes {kept} divisible, or set training.global_batch_size to "
            f"change the global batch. {_world_sizes_hint(config, kept)}"
        )
    logger.info(
        "global batch %d from the checkpoint (%s): %d microbatches of %d on each of %d DP ranks",
        kept, _keeps(config, saved, saved_seq_len, kept), kept // per_round, local, dp,
    )
    return kept, kept // per_round


def _check_explicit_batch(config: JobConfig, saved: int, saved_seq_len: int, kept: int, resume_dir: Path) -> None:
    """Refuses an explicit training.global_batch_size that contradicts training.global_batch_unit = 'tokens' on a
    resume with other sequences: the unit asks to keep the tokens per step, the size for another number."""
    t = config.training
    if t.global_batch_unit == "tokens" and saved_seq_len not in (0, t.seq_len):
        raise ConfigError(
            f"{resume_dir} was trained with {_keeps(config, saved, saved_seq_len, kept)}, but "
            f"training.global_batch_size = {t.global_batch_size} asks for {t.global_batch_size}. Set "
            f"global_batch_size = -1 (or {kept}), or training.global_batch_unit = 'sequences'."
        )


def _resolve(config: JobConfig, global_batch_size: int, dp: int) -> tuple[int, int]:
    """`resolve_batch_sizes`; a global batch this world size cannot split also names the world sizes that can
    (an elastic job re-formed on another number of nodes meets it)."""
    try:
        return resolve_batch_sizes(config.training.local_batch_size, global_batch_size, dp)
    except ConfigError as error:
        raise ConfigError(f"{error} {_world_sizes_hint(config, global_batch_size)}") from None


def _world_sizes_hint(config: JobConfig, global_batch_size: int) -> str:
    """`world_sizes_hint` for this job's fixed degrees and a fixed global batch of `global_batch_size`."""
    p, local = config.parallelism, config.training.local_batch_size
    if global_batch_size % local:
        return ""  # no data-parallel degree splits it: local_batch_size must change, not the world size
    rounds = global_batch_size // local
    degrees = p.tensor_parallel_degree, p.pipeline_parallel_degree, p.expert_parallel_degree
    return world_sizes_hint(*degrees, rounds, cp=p.context_parallel_degree)


def saved_batch(step_dir: Path, trust: Trust, allow_pickle: bool = False) -> tuple[int, int]:
    """The global batch size `step_dir` was trained with and its sequence length, read without a process group so
    that a resumed job can size its data loader and accumulation before building them; 0 for what the checkpoint
    predates or if it cannot be read."""
    saved = read_train_values(step_dir, ("global_batch_size", "seq_len"), trust, allow_pickle)
    if "global_batch_size" not in saved:
        return 0, 0
    return int(saved["global_batch_size"]), int(saved.get("seq_len", 0))
