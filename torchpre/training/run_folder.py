"""What a run leaves in `job.dump_folder` besides checkpoints, and how a new run or a resume treats what an earlier
one left there: the resolved config, the metrics of an unrelated run (moved aside), and, on a resume from an earlier
step than the last, the checkpoints and metrics records after it (moved aside, so the run goes on as one history).

The dump folder is the user's choice (a link there is followed); what torchpre keeps inside it is its own, and is never
written through a symbolic link: the folders it writes into must be folders (`check_run_folder`, before anything is
read or written), and each file is created new and renamed into place, or appended to only as a regular file
(`torchpre.confined`)."""

import logging
from pathlib import Path, PurePosixPath

import torch.distributed as dist

from torchpre.checkpoint.history import set_aside_earlier_metrics, set_aside_later_records, set_aside_later_steps
from torchpre.config.job_config import JobConfig
from torchpre.config.parser import to_toml
from torchpre.confined import file_kind, make_folder, write_file
from torchpre.errors import UntrustedInput
from torchpre.metrics.logger import MetricsLogger, build_metrics_logger

logger = logging.getLogger("torchpre")


def save_resolved_config(config: JobConfig) -> None:
    """Rank 0 writes the whole resolved config to the dump folder; the log gets one line saying where."""
    if dist.get_rank() != 0:
        return
    folder = make_folder(Path(config.job.dump_folder))
    write_file(folder / "config.toml", to_toml(config))
    source = config.job.config_file or "the defaults"
    logger.info("config: %s and the command line; resolved config in %s", source, folder / "config.toml")


def check_run_folder(config: JobConfig) -> None:
    """Every rank, before the run reads or writes anything in `job.dump_folder`: a symbolic link in place of a folder
    the run writes into (checkpoint.folder and hf_export.folder when relative, tensorboard/, wandb/, eval/,
    profiling.save_traces_folder, comm_traces/), or of metrics.jsonl, which it appends to, is an UntrustedInput error
    naming it, on every rank at once. A link could lead the run's writes, and the reads of a resume, out of the
    folder; a folder elsewhere is given by its own path (an absolute checkpoint.folder or hf_export.folder)."""
    folder = Path(config.job.dump_folder)
    names = (config.checkpoint.folder, config.hf_export.folder, "tensorboard", "wandb", "eval",
             config.profiling.save_traces_folder, "comm_traces", "metrics.jsonl")  # fmt: skip
    for name in names:
        beneath = not PurePosixPath(name).is_absolute() and ".." not in PurePosixPath(name).parts
        if beneath and folder.is_dir() and file_kind(folder, name) == "link":
            raise UntrustedInput(
                f"{folder / name} is, or leads through, a symbolic link, where the run keeps a file or folder of its "
                "own. torchpre never writes or resumes through a link, which could lead out of job.dump_folder: "
                f"remove it, or give another job.dump_folder; to keep checkpoints or exports on another disk, set "
                "checkpoint.folder or hf_export.folder to that path (docs/security.md)."
            )


def set_aside_later_history(config: JobConfig, checkpoint_folder: Path, step: int) -> None:
    """A resume from an explicit earlier step starts a new history: the checkpoints after it move to
    `superseded-from-step-N/` and the metrics records after it to `metrics.superseded-from-step-N.jsonl`, so this
    run's saves never overwrite them, a restart (load_step -1) continues this run rather than the old one, and
    metrics.jsonl holds each step once. A collective (the other ranks wait for rank 0's moves)."""
    if dist.get_rank() == 0:
        moved = set_aside_later_steps(checkpoint_folder, step)
        if moved is not None:
            names = ", ".join(path.name for path in sorted(moved.iterdir()))
            logger.warning(
                "checkpoint.load_step = %d: moved %s to %s, so that training on from step %d does not "
                "overwrite them; move them back by hand to resume the earlier run",
                step, names, moved, step,
            )
        records = set_aside_later_records(Path(config.job.dump_folder) / "metrics.jsonl", step)
        if records is not None:
            logger.warning(
                "checkpoint.load_step = %d: moved the metrics records of the steps after it to %s; metrics.jsonl "
                "goes on with this run's", step, records,
            )
    dist.barrier()


def open_metrics(config: JobConfig, resume_step: int) -> MetricsLogger:
    """Rank 0's metrics logger. A resume appends to metrics.jsonl (a redone step's last record is the one that
    counts) and continues the W&B run and TensorBoard directory; a new run in a folder that holds an earlier run's
    metrics moves them aside, so runs never mix."""
    folder = Path(config.job.dump_folder)
    if resume_step > 0:
        logger.info("resuming at step %d: appending to %s", resume_step, folder / "metrics.jsonl")
    elif moved := set_aside_earlier_metrics(folder):
        logger.warning(
            "job.dump_folder %s already holds metrics of an earlier run (this run resumes no checkpoint): "
            "moved them to %s; this run writes its own. Give each experiment its own job.dump_folder.",
            folder, ", ".join(str(path.relative_to(folder)) for path in moved),
        )
    return build_metrics_logger(config, resume_step=resume_step)
