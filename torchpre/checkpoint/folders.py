"""Where checkpoints live: `{folder}/step-N/` folders, complete by construction (a save writes `.tmp-step-N` and
renames it once done; a deletion renames first), so the names alone say which steps can be loaded.

torchpre deletes only what it made: a save marks its `.tmp-step-N` folder (`MARKER`) before writing anything, a
deletion marks the step folder before renaming it to `.tmp-removing-step-N`, and the clean-up of unfinished ones
removes a `.tmp-` folder only if its name is one of those two and it holds the marker (a regular file); it never
follows a symbolic link, and touches a marker only where it is a regular file (`torchpre.confined.touch_marker`).
Hugging Face exports (torchpre.interchange.export) and convert's output live by the same rules, through the one
sequence published.py runs over them. Nor does it delete a checkpoint it did not
choose to: a `step-N` that a new save of step N finds (from an earlier run) is moved aside to `replaced-step-N`, and
one that a resume found damaged and skipped to `damaged-step-N`; retention (checkpoint.keep_latest_k) counts and
removes `step-N` folders only.
"""

import logging
import os
import re
import shutil
from pathlib import Path

from torchpre.confined import is_regular_file, touch_marker
from torchpre.errors import TorchpreError, UntrustedInput

logger = logging.getLogger("torchpre")

STEP_DIR = re.compile(r"^step-(\d+)$")
TMP_PREFIX = ".tmp-"
UNFINISHED = re.compile(r"^\.tmp-(removing-)?step-\d+$")
MARKER = ".torchpre-checkpoint"
REPLACED, DAMAGED = "replaced-", "damaged-"


def complete_steps(folder: Path) -> list[int]:
    """Steps with a complete checkpoint in `folder`, ascending. A `step-N` that is a symbolic link is none: it may
    lead to another run's folder (`find_step_dir` refuses it by name)."""
    if not folder.is_dir():
        return []
    return sorted(
        int(m.group(1)) for p in folder.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir() and not p.is_symlink()
    )


def linked_steps(folder: Path) -> list[int]:
    """Steps whose `step-N` in `folder` is a symbolic link (no checkpoint: `complete_steps` leaves them out), ascending.
    A search for the latest names each as refused, so that one never goes unnoticed."""
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for p in folder.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_symlink())


def find_step_dir(folder: Path, load_step: int) -> Path | None:
    """The step folder to load: `load_step`, or the latest complete one (-1); None if there is none."""
    steps = complete_steps(folder)
    if load_step == -1:
        return folder / f"step-{steps[-1]}" if steps else None
    if load_step < 0:
        raise TorchpreError(
            f"checkpoint.load_step = {load_step} names no step: give a step number that {folder} holds, or -1 for "
            "the latest."
        )
    if (folder / f"step-{load_step}").is_symlink():
        raise UntrustedInput(
            f"checkpoint.load_step = {load_step}: {folder / f'step-{load_step}'} is a symbolic link, which may lead to "
            "another run's checkpoint; torchpre loads no step folder through one. Copy the checkpoint in its place, or "
            "load it as checkpoint.initial_load_path (docs/security.md)."
        )
    if load_step not in steps:
        available = ", ".join(map(str, steps)) or "none"
        raise TorchpreError(
            f"checkpoint.load_step = {load_step}, but {folder} has no complete step-{load_step} "
            f"(complete steps: {available}). Use -1 for the latest."
        )
    return folder / f"step-{load_step}"


def mark_as_ours(folder: Path) -> None:
    """Marks `folder` as made by torchpre, so that the clean-up of unfinished saves may remove it. A marker that is
    not a regular file (a symbolic link) is an UntrustedInput error, never touched through."""
    touch_marker(folder / MARKER)


def remove_step(step_dir: Path) -> None:
    """Deletes a checkpoint folder without ever leaving a half-deleted `step-N`: marked, renamed away first (a
    `.tmp-` name, which a restart clears), then deleted. A symbolic link is refused (OSError), never followed."""
    if step_dir.is_symlink():
        raise OSError(f"{step_dir} is a symbolic link; torchpre deletes no folder through one")
    doomed = step_dir.with_name(f"{TMP_PREFIX}removing-{step_dir.name}")
    if (doomed.is_symlink() or doomed.exists()) and not remove_if_ours(doomed):
        raise OSError(f"{doomed} is in the way, and torchpre did not make it")
    mark_as_ours(step_dir)
    step_dir.rename(doomed)
    shutil.rmtree(doomed)


def remove_unfinished(folder: Path) -> list[Path]:
    """Removes the `.tmp-` folders in `folder` that saves or deletions left when they did not finish (a crashed
    run's), and only those: its name is torchpre's and it holds the marker. Everything else with a `.tmp-` name is
    left, with a warning. Returns what was removed, each logged."""
    removed = []
    for path in sorted(folder.glob(f"{TMP_PREFIX}*")):
        if remove_if_ours(path):
            removed.append(path)
            logger.info("removed %s, left by a save or deletion that did not finish", path)
    return removed


def remove_if_ours(path: Path, names: re.Pattern[str] = UNFINISHED) -> bool:
    """Removes `path` if torchpre made it (see `remove_unfinished`; `names`: the names it gives such folders); False,
    with a warning, otherwise."""
    if path.is_symlink():
        why = "it is a symbolic link"
    elif not path.is_dir() or not names.match(path.name):
        why = "its name is not one torchpre gives its unfinished checkpoints"
    elif not is_regular_file(path / MARKER):
        why = f"it lacks torchpre's marker {MARKER}"
    else:
        shutil.rmtree(path)
        return True
    logger.warning("left %s in place: %s, so torchpre did not make it (remove it yourself if unwanted)", path, why)
    return False


def move_aside(step_dir: Path, prefix: str) -> Path:
    """Renames `step_dir` to `{prefix}step-N` beside it (a fresh `-2`, `-3` ... name if that exists); returns it."""
    target = step_dir.with_name(f"{prefix}{step_dir.name}")
    number = 1
    while target.exists() or target.is_symlink():
        number += 1
        target = step_dir.with_name(f"{prefix}{step_dir.name}-{number}")
    step_dir.rename(target)
    return target


def move_aside_damaged(folder: Path, newest: int) -> None:
    """Moves every `step-N` of `folder` after step `newest` (the latest intact one, -1 for none: the damaged ones a
    search for the latest skipped, links included) aside to `damaged-step-N`, each logged, so that retention never
    counts them and a later save of their step does not replace them."""
    for step in sorted({*complete_steps(folder), *linked_steps(folder)}):
        if step > newest:
            target = move_aside(folder / f"step-{step}", DAMAGED)
            logger.warning("moved the damaged checkpoint step-%d aside to %s; torchpre never deletes it", step, target)


def publish(tmp: Path, final: Path) -> Path | None:
    """Gives a finished `.tmp-` folder its final name (`rename_durably`). A folder already of that name (a damaged
    checkpoint a resume skipped, or an earlier run's) is moved aside first (`move_aside`), and its new path returned
    and logged; None when there was none."""
    replaced = move_aside(final, REPLACED) if final.exists() or final.is_symlink() else None
    if replaced is not None:
        logger.warning(
            "%s existed already (an earlier run's): moved it aside to %s, which torchpre never deletes, and published "
            "the new checkpoint in its place",
            final, replaced,
        )  # fmt: skip
    rename_durably(tmp, final)
    return replaced


def rename_durably(source: Path, target: Path) -> None:
    """Renames `source` to `target` (replacing an empty folder there, as rename(2) does) and flushes the rename to the
    disk, so that a power loss after it does not undo it."""
    source.rename(target)
    folder = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
