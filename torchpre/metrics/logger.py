"""Writes one record per logged step: a line on stdout and one entry in each configured sink
(metrics.jsonl always; Weights & Biases and TensorBoard when enabled)."""

import logging
from pathlib import Path
from typing import Any

from torchpre.checkpoint.history import superseded_records
from torchpre.config.job_config import JobConfig
from torchpre.config.parser import to_dict, to_toml
from torchpre.metrics.sinks import JsonlSink, Sink, TensorBoardSink, WandbSink, last_logged_step

logger = logging.getLogger("torchpre")


class MetricsLogger:
    """Fans each record out to its sinks, so adding a backend means adding a sink, not editing the loop."""

    def __init__(self, sinks: list[Sink]):
        self._sinks = sinks

    def log(self, record: dict[str, Any]) -> None:
        for sink in self._sinks:
            sink.log(record)
        logger.info(format_step_line(record))

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()


def build_metrics_logger(config: JobConfig, resume_step: int = 0) -> MetricsLogger:
    """metrics.jsonl plus the trackers that `config.metrics` turns on, all under `job.dump_folder`.
    `resume_step` is the step of the checkpoint the job resumed (0 for a new run): the trackers then
    continue the run already in the folder, each step once (see torchpre.metrics.sinks)."""
    folder, m = config.job.dump_folder, config.metrics
    logged_through = logged_steps(Path(folder)) if resume_step else None
    sinks: list[Sink] = [JsonlSink(folder)]
    if m.enable_wandb:
        sinks.append(
            WandbSink(folder, to_dict(config), m.wandb_project, m.wandb_run_name, m.wandb_entity, logged_through)
        )
    if m.enable_tensorboard:
        sinks.append(TensorBoardSink(folder, to_toml(config), resume_step))
    return MetricsLogger(sinks)


def logged_steps(folder: Path) -> int:
    """The last step this run's trackers logged: the highest of metrics.jsonl and of the records a resume from an
    earlier step moved aside (`metrics.superseded-from-step-N.jsonl`), which W&B holds too."""
    files = [folder / "metrics.jsonl", *superseded_records(folder)]
    return max(last_logged_step(path) for path in files)


def format_step_line(record: dict[str, Any]) -> str:
    """A concise human view of a record, e.g. `step 10 | loss 5.1234 | lr 8.0e-04 | ...`; steps that
    ran validation show `val_loss` next to the training loss."""
    val_loss = [f"val_loss {record['val_loss']:.4f}"] if "val_loss" in record else []
    of_peak = f" of the {record['mfu_peak']} peak" if record.get("mfu_peak") else ""
    return " | ".join(
        [
            f"step {record['step']:>5}",
            f"loss {record['loss']:.4f}",
            *val_loss,
            f"lr {record['lr']:.2e}",
            f"gnorm {record['grad_norm']:.3f}",
            f"{record['tokens_per_sec']:,.0f} tok/s",
            f"mfu {100 * record['mfu']:.1f}%{of_peak}",
            f"mem {record['max_memory_bytes'] / 2**30:.2f} GiB",
            f"{record['step_time_s']:.3f} s/step (data {record['data_time_s']:.3f} s)",
        ]
    )
