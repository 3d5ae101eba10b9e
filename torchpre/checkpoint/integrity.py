"""Checkpoint integrity: `manifest.json` records every file's size and CRC-32 as a save writes it (storage.py);
loading checks them, so a file truncated or altered after the save is named instead of loaded, and `load_step = -1`
falls back past a corrupt checkpoint, on every rank alike."""

import json
import logging
import zlib
from pathlib import Path
from typing import Any

import torch.distributed as dist

from torchpre.checkpoint.folders import complete_steps, find_step_dir
from torchpre.errors import TorchpreError

logger = logging.getLogger("torchpre")

MANIFEST = "manifest.json"


def checkpoint_problems(step_dir: Path) -> list[str]:
    """Every file of `step_dir` that does not match its manifest. Under a process group each rank checks a
    share and all get all; without one (convert) this process checks every file."""
    if not dist.is_initialized():
        return verify_share(step_dir, 0, 1)
    share = verify_share(step_dir, dist.get_rank(), dist.get_world_size())
    return sorted(problem for part in all_gather(share) for problem in part)


def find_intact_step(folder: Path, load_step: int) -> Path | None:
    """The intact step folder to load, the same on every rank; None if there is none.

    With -1, a corrupt latest checkpoint is skipped with a warning for the one before it (a job killed
    mid-save is the common case, but disks and copies corrupt files too); a chosen step that is corrupt
    is an error, since loading another one silently would not be what was asked.
    """
    if load_step != -1:
        step_dir = find_step_dir(folder, load_step)
        require_intact(step_dir, f"checkpoint.load_step = {load_step}")
        return step_dir
    corrupt = []
    for step in reversed(complete_steps(folder)):
        step_dir = folder / f"step-{step}"
        problems = checkpoint_problems(step_dir)
        if not problems:
            return step_dir
        corrupt.append(f"{step_dir} ({'; '.join(problems)})")
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.warning("checkpoint %s is corrupt: %s. Trying the one before it.", step_dir, "; ".join(problems))
    if corrupt:
        raise TorchpreError(
            f"Every checkpoint in {folder} is corrupt: {'; '.join(corrupt)}. Restore the files, or move the "
            "folder away (or set checkpoint.folder elsewhere) to start from scratch."
        )
    return None


def require_intact(step_dir: Path, key: str) -> None:
    """Raises, naming `key` (the setting that chose the folder) and the bad files, unless `step_dir` is intact."""
    problems = checkpoint_problems(step_dir)
    if problems:
        raise TorchpreError(
            f"{key}: the checkpoint {step_dir} is corrupt: {'; '.join(problems)}. Load another checkpoint "
            "(checkpoint.load_step = -1 loads the latest intact one) or restore the files."
        )


def verify_share(step_dir: Path, rank: int, world_size: int) -> list[str]:
    """This rank's share (every world_size-th file of the manifest) of checking `step_dir`: one line per file
    that is missing, has another size or fails its checksum (when the save took checksums). A folder without a
    manifest predates them and is trusted, as its atomic rename already vouches for its completeness."""
    path = step_dir / MANIFEST
    if not path.is_file():
        return []
    try:
        files = json.loads(path.read_text(encoding="utf-8"))["files"]
        expected = [(name, int(files[name]["size"]), _optional_int(files[name].get("crc32"))) for name in sorted(files)]
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        return [f"{path} is unreadable ({type(error).__name__}: {error})"] if rank == 0 else []
    if rank == 0 and any(crc is None for _, _, crc in expected):
        logger.info(
            'checkpoint %s was saved without checksums (checkpoint.checksums = "off"): only its file sizes are '
            "checked, so altered bytes would go unnoticed",
            step_dir,
        )
    problems = []
    for name, size, crc in expected[rank::world_size]:
        file = step_dir / name
        try:  # an unreadable file is a finding, not an exception: the other ranks wait for this one's answer
            if not file.is_file():
                problems.append(f"{file} is missing")
            elif file.stat().st_size != size:
                problems.append(f"{file} has {file.stat().st_size} bytes, not the {size} it was saved with")
            elif crc is not None and _crc32(file) != crc:
                problems.append(f"{file} fails its CRC-32 check (its bytes changed after the save)")
        except OSError as error:
            problems.append(f"{file} cannot be read ({error})")
    return problems


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as file:
        while chunk := file.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def all_gather(value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's `value` (of `group`), by rank."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered
