"""What a dump folder already holds from earlier runs: checkpoints and metrics records after a chosen resume step,
and the metrics of an unrelated run. Each is moved aside (never deleted, never mixed with this run's).

A symbolic link in the dump folder is never followed: it is not an earlier run's metrics (it stays, for the writer
of that name to refuse), a fresh name is one that holds nothing, not even a link, and metrics.jsonl is read only as a
regular file and rewritten as a new file renamed into place (`torchpre.confined`)."""

import json
import re
from pathlib import Path

from torchpre.checkpoint.folders import complete_steps
from torchpre.confined import file_kind, open_file, write_file

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
    earlier = [path for path in paths if _has_content(folder, path)]
    number = 1
    while any(_taken(_numbered(path, number)) for path in paths):
        number += 1
    moved = [_numbered(path, number) for path in earlier]
    for path, target in zip(earlier, moved):
        path.rename(target)
    return moved


def _has_content(folder: Path, path: Path) -> bool:
    """Whether `path` in `folder` is a non-empty file or folder, reached without a symbolic link."""
    kind = file_kind(folder, str(path.relative_to(folder)))
    if kind == "file":
        return path.stat().st_size > 0
    return kind == "other" and path.is_dir() and any(path.iterdir())


def _taken(path: Path) -> bool:
    return path.exists() or path.is_symlink()


def _numbered(path: Path, number: int) -> Path:
    return path.with_name(f"{path.stem}.{number}{path.suffix}")


def _fresh(path: Path) -> Path:
    number = 1
    candidate = path
    while _taken(candidate):
        number += 1
        candidate = path.with_name(f"{path.name}-{number}")
    return candidate


def set_aside_later_records(metrics: Path, step: int) -> Path | None:
    """Moves the records of `metrics` (a metrics.jsonl) of the steps after `step` to
    `metrics.superseded-from-step-{step}.jsonl` beside it (a fresh `-2`, `-3` ... name if that exists), keeping the
    others in place; returns that file, or None when there were none (or no such file). Lines that are not a JSON
    record with a step stay. metrics.jsonl is read only as a regular file (a symbolic link there is an UntrustedInput
    error) and both files are written new and renamed into place, never through a link."""
    try:
        with open_file(metrics.parent, metrics.name) as file:
            text = file.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return None
    kept, later = [], []
    for line in text.splitlines(keepends=True):
        (later if _record_step(line) > step else kept).append(line)
    if not later:
        return None
    target = metrics.with_name(f"metrics.superseded-from-step-{step}.jsonl")
    number = 1
    while _taken(target):
        number += 1
        target = metrics.with_name(f"metrics.superseded-from-step-{step}-{number}.jsonl")
    write_file(target, "".join(later))
    write_file(metrics, "".join(kept))
    return target


def superseded_records(folder: Path) -> list[Path]:
    """The records `set_aside_later_records` moved aside in `folder`, oldest name first."""
    return sorted(path for path in folder.glob("metrics.superseded-from-step-*.jsonl") if SUPERSEDED.match(path.name))


def _record_step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return -1
