"""Where a metrics record goes: one small class per backend, each with `log(record)` and `close()`.

A record is the dict of one logged step (`step` plus scalar metrics, and a few strings such as
`nonfinite/first_module`, which TensorBoard stores as text). Every sink stores the same names, so a curve
found in metrics.jsonl is found under that name in W&B and TensorBoard too.

A job that resumes a checkpoint of step N redoes the steps after N that an interrupted attempt had
already logged. Each backend keeps one record per step: metrics.jsonl appends them (its readers keep
a step's last record), TensorBoard hides the earlier attempt's events from step N + 1 on, and W&B
keeps the records it already has (see `WandbSink`).

The files and folders a sink keeps in the dump folder are its own: metrics.jsonl is appended to only when it is a
regular file, `tensorboard/` and `wandb/` are folders (never a symbolic link to one), and `wandb/run_id` is
replaced, never written through a link (`torchpre.confined`). The files TensorBoard and W&B write inside their
folders are theirs; they are written under new names.
"""

import io
import json
import os
from pathlib import Path
from typing import Any, Protocol

from torchpre.confined import make_folder, open_file, open_for_append, read_file, write_file
from torchpre.optional import import_tensorboard, import_wandb

RUN_ID_LIMIT = 1024  # a W&B run id is 8 characters; the file holds nothing else


class Sink(Protocol):
    def log(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's metrics without `step`, which every tracker takes as its own step axis."""
    return {name: value for name, value in record.items() if name != "step"}


class JsonlSink:
    """Appends JSON lines to `{dump_folder}/metrics.jsonl`, flushed per line so a crash loses nothing; a symbolic
    link at that name is an UntrustedInput error, never appended through."""

    def __init__(self, dump_folder: str | Path):
        folder = make_folder(Path(dump_folder))
        self._file = io.TextIOWrapper(open_for_append(folder / "metrics.jsonl"), encoding="utf-8")

    def log(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def last_logged_step(path: Path) -> int:
    """The highest step among the complete records at the end of `path` (metrics.jsonl), 0 if none. Reads
    only the last MiB, which holds hundreds of records, so a long run's large file costs nothing; a symbolic link
    there is an UntrustedInput error, never read through."""
    try:
        file = open_file(path.parent, path.name)
    except FileNotFoundError:
        return 0
    with file:
        file.seek(max(0, file.seek(0, os.SEEK_END) - 2**20))
        lines = file.read().split(b"\n")
    steps = [0]
    for line in lines:  # a line cut by the window's start or by a crash mid-write does not parse
        try:
            steps.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):
            continue
    return max(steps)


class WandbSink:
    """One Weights & Biases run per training run, kept under `{dump_folder}/wandb` next to the job's other
    outputs; `WANDB_MODE=offline` keeps it on disk for a later `wandb sync`.

    The run's id is written to `{dump_folder}/wandb/run_id` when it starts. A job that resumes a checkpoint
    (`logged_through` is not None) continues that run (`resume="allow"`), so the curves stay one line; a
    new run in the folder starts a new W&B run (the trainer has moved the old id aside).

    A step is logged to a W&B run once: a resumed job skips the steps up to `logged_through`, the last
    step the interrupted attempt logged (read from metrics.jsonl). W&B cannot replace logged steps: wandb
    drops a step below the run's current one (an online resume starts from the server's last step), and
    rewinding a run (`resume_from`) is a private preview of W&B's server. So a redone step keeps its
    first attempt's values in W&B: the same loss, grad norm and val_loss (training is deterministic),
    the same lr unless the restart changed the schedule (e.g. training.steps), but the first attempt's
    timings, throughput, MFU and memory; metrics.jsonl and TensorBoard hold the redone values. This
    assumes W&B was on in the earlier attempts; a job resumed from an earlier `checkpoint.load_step`
    likewise keeps W&B's values of the steps the superseded attempt logged.
    """

    def __init__(
        self,
        dump_folder: str | Path,
        config: dict[str, Any],
        project: str,
        run_name: str,
        entity: str,
        logged_through: int | None = None,
    ):
        wandb = import_wandb()
        id_file = make_folder(Path(dump_folder), "wandb") / "run_id"
        run_id = _stored_run_id(id_file) if logged_through is not None else None
        self._skip_through = logged_through if run_id else 0
        self._run = wandb.init(
            project=project,
            name=run_name or None,
            entity=entity or None,
            dir=str(dump_folder),
            config=config,
            id=run_id,
            resume="allow" if run_id else None,
        )
        write_file(id_file, self._run.id)

    def log(self, record: dict[str, Any]) -> None:
        if record["step"] > self._skip_through:
            self._run.log(scalars(record), step=record["step"])

    def close(self) -> None:
        self._run.finish()


class TensorBoardSink:
    """Scalars under `{dump_folder}/tensorboard`, the training step as global_step, and the resolved config
    as a text summary at the step the job starts from (0, or the resumed step), so the event files say which
    job produced them.

    A job resumed from step `resume_step` writes a new event file in the same directory that starts with
    `purge_step = resume_step + 1`: TensorBoard hides the earlier files' events from that step on, so a
    step redone after a crash shows once, with the redone values."""

    def __init__(self, dump_folder: str | Path, config_toml: str, resume_step: int = 0):
        tensorboard = import_tensorboard()
        folder = make_folder(Path(dump_folder), "tensorboard")
        purge_step = resume_step + 1 if resume_step else None
        self._writer = tensorboard.SummaryWriter(log_dir=str(folder), purge_step=purge_step)
        self._writer.add_text("config", f"```toml\n{config_toml}```", global_step=resume_step)

    def log(self, record: dict[str, Any]) -> None:
        for name, value in scalars(record).items():
            if isinstance(value, str):  # e.g. nonfinite/first_module
                self._writer.add_text(name, value, global_step=record["step"])
            else:
                self._writer.add_scalar(name, value, global_step=record["step"])
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _stored_run_id(path: Path) -> str | None:
    """The W&B run id an earlier attempt of this run stored, None if it ran without W&B; read only from a regular
    file of at most RUN_ID_LIMIT bytes, never through a symbolic link."""
    try:
        return read_file(path.parent, path.name, RUN_ID_LIMIT).decode("utf-8", errors="replace").strip() or None
    except FileNotFoundError:
        return None
