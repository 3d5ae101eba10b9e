"""Writes one record per logged step: a line on stdout and a line of metrics.jsonl."""

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger("torchpre")


class MetricsLogger:
    """Appends JSON lines to `{dump_folder}/metrics.jsonl`, flushed per line so a crash loses nothing."""

    def __init__(self, dump_folder: str | Path):
        path = Path(dump_folder) / "metrics.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")

    def log(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        logger.info(format_step_line(record))

    def close(self) -> None:
        self._file.close()


def format_step_line(record: dict[str, Any]) -> str:
    """A concise human view of a record, e.g. `step 10 | loss 5.1234 | lr 8.0e-04 | ...`; steps that
    ran validation show `val_loss` next to the training loss."""
    val_loss = [f"val_loss {record['val_loss']:.4f}"] if "val_loss" in record else []
    return " | ".join(
        [
            f"step {record['step']:>5}",
            f"loss {record['loss']:.4f}",
            *val_loss,
            f"lr {record['lr']:.2e}",
            f"gnorm {record['grad_norm']:.3f}",
            f"{record['tokens_per_sec']:,.0f} tok/s",
            f"mfu {100 * record['mfu']:.1f}%",
            f"mem {record['max_memory_bytes'] / 2**30:.2f} GiB",
            f"{record['step_time_s']:.3f} s/step (data {record['data_time_s']:.3f} s)",
        ]
    )
