"""What a dump folder already holds from earlier runs: checkpoints after a chosen resume step, and the
metrics file of an unrelated run. Each is moved aside (never deleted, never mixed with this run's)."""

from pathlib import Path

from torchpre.checkpoint.manager import complete_steps


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


def start_new_metrics_file(path: Path) -> Path | None:
    """Renames an earlier run's non-empty `path` (metrics.jsonl) to `metrics.1.jsonl`, `metrics.2.jsonl` ...
    so a new run writes a file of its own; returns the new name, or None if there was nothing to move."""
    if not path.is_file() or path.stat().st_size == 0:
        return None
    number = 1
    while (moved := path.with_name(f"{path.stem}.{number}{path.suffix}")).exists():
        number += 1
    path.rename(moved)
    return moved


def _fresh(path: Path) -> Path:
    number = 1
    candidate = path
    while candidate.exists():
        number += 1
        candidate = path.with_name(f"{path.name}-{number}")
    return candidate
