"""Where a metrics record goes: one small class per backend, each with `log(record)` and `close()`.

A record is the dict of one logged step (`step` plus scalar metrics, and a few strings such as
`nonfinite/first_module`, which TensorBoard stores as text). Every sink stores the same names, so a curve
found in metrics.jsonl is found under that name in W&B and TensorBoard too.
"""

import json
from pathlib import Path
from typing import Any, Protocol

from torchpre.optional import import_tensorboard, import_wandb


class Sink(Protocol):
    def log(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's metrics without `step`, which every tracker takes as its own step axis."""
    return {name: value for name, value in record.items() if name != "step"}


class JsonlSink:
    """Appends JSON lines to `{dump_folder}/metrics.jsonl`, flushed per line so a crash loses nothing."""

    def __init__(self, dump_folder: str | Path):
        path = Path(dump_folder) / "metrics.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")

    def log(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class WandbSink:
    """One Weights & Biases run per job, kept under `{dump_folder}/wandb` next to the job's other outputs;
    `WANDB_MODE=offline` keeps it on disk for a later `wandb sync`."""

    def __init__(self, dump_folder: str | Path, config: dict[str, Any], project: str, run_name: str, entity: str):
        wandb = import_wandb()
        Path(dump_folder).mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=project, name=run_name or None, entity=entity or None, dir=str(dump_folder), config=config
        )

    def log(self, record: dict[str, Any]) -> None:
        self._run.log(scalars(record), step=record["step"])

    def close(self) -> None:
        self._run.finish()


class TensorBoardSink:
    """Scalars under `{dump_folder}/tensorboard`, the training step as global_step, and the resolved config
    as a text summary so the event files say which job produced them."""

    def __init__(self, dump_folder: str | Path, config_toml: str):
        tensorboard = import_tensorboard()
        self._writer = tensorboard.SummaryWriter(log_dir=str(Path(dump_folder) / "tensorboard"))
        self._writer.add_text("config", f"```toml\n{config_toml}```")

    def log(self, record: dict[str, Any]) -> None:
        for name, value in scalars(record).items():
            if isinstance(value, str):  # e.g. nonfinite/first_module
                self._writer.add_text(name, value, global_step=record["step"])
            else:
                self._writer.add_scalar(name, value, global_step=record["step"])
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
