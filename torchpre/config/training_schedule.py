"""The training schedule's own values, read and checked in one place: `training.batch_rampup`'s three numbers and
each `[[training.data_stages]]` table's. `validate_config` checks them before any work; the step plan
(`torchpre.training.step_plan`, `torchpre.training.stages`) builds on them."""

from torchpre.config.job_config import DataStage, JobConfig
from torchpre.errors import ConfigError

STAGES_KEY = "training.data_stages"
RAMP_KEY = "training.batch_rampup"


def stage_name(index: int, entry: DataStage) -> str:
    return entry.name or f"stage-{index + 1}"


def check_data_stage(config: JobConfig, index: int, entry: DataStage) -> None:
    """One `[[training.data_stages]]` table's values: one way to give its start (none for the first), each in range,
    and a mixture only where the job reads shard folders. Where stages start relative to each other is
    `torchpre.training.stages.StageTable`'s to check, once every start is resolved."""
    where = f"{STAGES_KEY} stage {index + 1} ('{stage_name(index, entry)}')"
    starts = [key for key, given in (("start_step", entry.start_step is not None),
                                     ("start_fraction", entry.start_fraction is not None),
                                     ("start_at_decay", entry.start_at_decay)) if given]  # fmt: skip
    if len(starts) > 1:
        raise ConfigError(f"{where} sets {' and '.join(starts)}: give one of them.")
    if not starts and index > 0:
        raise ConfigError(f"{where} has no start: give start_step, start_fraction or start_at_decay = true.")
    if entry.start_step is not None and entry.start_step < 0:
        raise ConfigError(f"{where}: start_step = {entry.start_step} must be at least 0.")
    if entry.start_fraction is not None and not 0 <= entry.start_fraction < 1:
        raise ConfigError(f"{where}: start_fraction = {entry.start_fraction} must be in [0, 1).")
    if entry.seq_len < 0:
        raise ConfigError(f"{where}: seq_len = {entry.seq_len} must be positive (or 0 for training.seq_len).")
    if entry.mixture and config.training.dataset != "shards":
        raise ConfigError(
            f"{where} has a mixture of shard folders, which needs training.dataset = 'shards' (it is "
            f"'{config.training.dataset}'). Set training.dataset = 'shards', or leave the stage's mixture out to "
            "train on the job's data."
        )


def ramp_values(text: str, final: int) -> tuple[int, int, int] | None:
    """(start, increment, samples) of the ramp `text` ("start,increment,samples") towards the global batch `final`;
    None for "" (no ramp)."""
    if not text.strip():
        return None
    usage = f'{RAMP_KEY} = "{text}": expected "start,increment,samples", three integers (e.g. "16,16,1000000")'
    try:
        start, increment, samples = (int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"{usage}.") from None
    if start < 1 or increment < 1 or samples < 0:
        raise ConfigError(f"{usage}: start and increment must be at least 1, samples at least 0.")
    if final == -1:
        raise ConfigError(
            f"{RAMP_KEY} ramps the global batch up to training.global_batch_size, which is -1 (derived): set "
            "training.global_batch_size to the batch the ramp ends at."
        )
    if start > final:
        raise ConfigError(
            f"{RAMP_KEY} starts at {start} sequences, more than training.global_batch_size = {final}: a ramp grows "
            "the batch, so start must be at most the global batch."
        )
    if (final - start) % increment:
        raise ConfigError(
            f"{RAMP_KEY} grows from {start} by {increment}, which never reaches training.global_batch_size = "
            f"{final}: choose an increment that divides {final} - {start} = {final - start}."
        )
    return start, increment, samples
