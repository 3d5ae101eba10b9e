"""What a dump folder already holds from earlier runs: checkpoints and metrics records after a chosen resume step,
and the metrics of an unrelated run. Each is moved aside (never deleted, never mixed with this run's)."""

import json
import re
from pathlib import Path

from torchpre.checkpoint.folders import complete_steps

SUPERSEDED = re.compile(r"^metrics\.superseded-from-step-\d+(-\d+)?\.jsonl$")


def set_aside_later_steps(folder: Path, step: int) -> Path | None:
    """Moves the complete checkpoints after `step` into `{folder}/superseded-from-step-{step}/` (a fresh
    `-2`, `-3` ... name if that exists); returns that folder, or None when there was nothing later."""
    later = [s for s in complete_steps(folder) if s > step]
    if not later:
        return None
    target = _fresh(folder / f"superseded-from-step-{step}")
    target.mkdir()
    for s in later:
        (folder / f"step-{s}").rename(target / f"step-{s}")
    return target


def set_aside_earlier_metrics(folder: Path) -> list[Path]:
    """Renames an earlier run's non-empty `metrics.jsonl`, `tensorboard/` and `wandb/run_id` in `folder` to
    `metrics.N.jsonl`, `tensorboard.N` and `wandb/run_id.N` (the first N free for all, so they keep one
    number): a new run writes files of its own, TensorBoard never shows two runs as one, and a resume of
    the new run never continues the old W&B run. Returns the new names (none if nothing to move)."""
    paths = (folder / "metrics.jsonl", folder / "tensorboard", folder / "wandb" / "run_id", *superseded_records(folder))
    earlier = [path for path in paths if _has_content(path)]
    number = 1
    while any(_numbered(path, number).exists() for path in paths):
        number += 1
    moved = [_numbered(path, number) for path in earlier]
    for path, target in zip(earlier, moved):
        path.rename(target)
    return moved


def _has_content(path: Path) -> bool:
    return path.stat().st_size > 0 if path.is_file() else path.is_dir() and any(path.iterdir())


def _numbered(path: Path, number: int) -> Path:
    return path.with_name(f"{path.stem}.{number}{path.suffix}")


def _fresh(path: Path) -> Path:
    number = 1
    candidate = path
    while candidate.exists():
        number += 1
        candidate = path.with_name(f"{path.name}-{number}")
    return candidate


def set_aside_later_records(metrics: Path, step: int) -> Path | None:
    """Moves the records of `metrics` (a metrics.jsonl) of the steps after `step` to
    `metrics.superseded-from-step-{step}.jsonl` beside it (a fresh `-2`, `-3` ... name if that exists), keeping the
    others in place; returns that file, or None when there were none (or no such file). Lines that are not a JSON
    record with a step stay."""
    if not metrics.is_file():
        return None
    kept, later = [], []
    for line in metrics.read_text(encoding="utf-8").splitlines(keepends=True):
        (later if _record_step(line) > step else kept).append(line)
    if not later:
        return None
    target = metrics.with_name(f"metrics.superseded-from-step-{step}.jsonl")
    number = 1
    while target.exists():
        number += 1
        target = metrics.with_name(f"metrics.superseded-from-step-{step}-{number}.jsonl")
    target.write_text("".join(later), encoding="utf-8")
    replacement = metrics.with_name(f".{metrics.name}.tmp")
    replacement.write_text("".join(kept), encoding="utf-8")
    replacement.replace(metrics)
    return target


def superseded_records(folder: Path) -> list[Path]:
    """The records `set_aside_later_records` moved aside in `folder`, oldest name first."""
    return sorted(path for path in folder.glob("metrics.superseded-from-step-*.jsonl") if SUPERSEDED.match(path.name))


def _record_step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return -1
