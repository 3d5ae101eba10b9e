"""Where checkpoints live: `{folder}/step-N/` folders, complete by construction (a save writes `.tmp-step-N` and
renames it once done; a deletion renames first), so the names alone say which steps can be loaded."""

import os
import re
import shutil
from pathlib import Path

from torchpre.errors import TorchpreError

STEP_DIR = re.compile(r"^step-(\d+)$")
TMP_PREFIX = ".tmp-"


def complete_steps(folder: Path) -> list[int]:
    """Steps with a complete checkpoint in `folder`, ascending."""
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for p in folder.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir())


def find_step_dir(folder: Path, load_step: int) -> Path | None:
    """The step folder to load: `load_step`, or the latest complete one (-1); None if there is none."""
    steps = complete_steps(folder)
    if load_step == -1:
        return folder / f"step-{steps[-1]}" if steps else None
    if load_step not in steps:
        available = ", ".join(map(str, steps)) or "none"
        raise TorchpreError(
            f"checkpoint.load_step = {load_step}, but {folder} has no complete step-{load_step} "
            f"(complete steps: {available}). Use -1 for the latest."
        )
    return folder / f"step-{load_step}"


def remove_step(step_dir: Path) -> None:
    """Deletes a checkpoint folder without ever leaving a half-deleted `step-N`: renamed away first (a `.tmp-`
    name, which a restart clears), then deleted."""
    doomed = step_dir.with_name(f"{TMP_PREFIX}removing-{step_dir.name}")
    shutil.rmtree(doomed, ignore_errors=True)
    step_dir.rename(doomed)
    shutil.rmtree(doomed)


def publish(tmp: Path, final: Path) -> None:
    """Gives a finished `.tmp-` folder its final name (replacing a folder of that name: a step saved again) and
    flushes the rename to the disk, so that a power loss after it does not undo it."""
    if final.exists():
        remove_step(final)
    tmp.rename(final)
    folder = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
