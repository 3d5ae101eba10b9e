"""Checkpoint integrity: `manifest.json` records every file's size and CRC-32 as a save writes it (storage.py);
loading checks them, so a file truncated or altered after the save is named instead of loaded, and `load_step = -1`
falls back past a corrupt checkpoint, on every rank alike. A step folder without a manifest cannot be checked: it is
refused, naming checkpoint.allow_unverified, which loads it with a warning.

The manifest is {"checksums": "write" | "off", "files": {name: {"size": bytes, "crc32": CRC-32}}}: "crc32" is left
out under "off", and manifests written before checkpoint.checksums existed lack "checksums" (they hold every CRC).
"""

import json
import logging
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from torchpre.checkpoint.folders import complete_steps, find_step_dir
from torchpre.errors import FieldError, TorchpreError, field

logger = logging.getLogger("torchpre")

MANIFEST = "manifest.json"
ALLOW_UNVERIFIED = "checkpoint.allow_unverified"
LATEST = "checkpoint.load_step = -1 (the latest checkpoint)"  # the setting that chose the folder, in messages
CHECKSUMS = ("write", "off")


@dataclass(frozen=True)
class FileRecord:
    """What the manifest says of one file: its size and, unless saved with checksums "off", its CRC-32."""

    size: int
    crc32: int | None


def write_manifest(step_dir: Path, checksums: str, files: dict[str, dict[str, int]]) -> None:
    """Writes `step_dir`'s manifest (`checksums`: the setting the records were taken under) and flushes it to the
    disk, so that the rename publishing the folder never survives a power loss the manifest did not."""
    with open(step_dir / MANIFEST, "w", encoding="utf-8") as file:
        json.dump({"checksums": checksums, "files": files}, file, indent=1, sort_keys=True)
        file.flush()
        os.fsync(file.fileno())


def read_manifest(step_dir: Path) -> dict[str, FileRecord] | None:
    """`step_dir`'s file records by name, every field checked; None when it has no manifest. A manifest that does
    not parse, lacks a key or holds a value of the wrong type raises a TorchpreError naming the file and the key."""
    path = step_dir / MANIFEST
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        checksums = field(record, "checksums", str, default="write")
        if checksums not in CHECKSUMS:
            raise FieldError(f"'checksums' is {checksums!r}, not 'write' or 'off'")
        files = field(record, "files", dict)
        return {name: _file_record(files, name, checksums == "write") for name in sorted(files)}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, FieldError) as error:
        raise TorchpreError(f"{path} is not a valid manifest ({error})") from None


def _file_record(files: dict[str, Any], name: str, with_crc: bool) -> FileRecord:
    where = f"files.{name}"
    size = field(files[name], "size", int, where)
    if size < 0:
        raise FieldError(f"'{where}.size' is {size}, not a size in bytes")
    crc = field(files[name], "crc32", int, where) if with_crc else field(files[name], "crc32", int, where, None)
    return FileRecord(size, crc)


def checkpoint_problems(step_dir: Path) -> list[str] | None:
    """Every file of `step_dir` that does not match its manifest; None when it has no manifest to check against.
    Under a process group each rank checks a share and all get all; without one (convert) this process checks
    every file."""
    if not (step_dir / MANIFEST).is_file():
        return None
    if not dist.is_initialized():
        return verify_share(step_dir, 0, 1)
    share = verify_share(step_dir, dist.get_rank(), dist.get_world_size())
    return sorted(problem for part in all_gather(share) for problem in part)


def find_intact_step(folder: Path, load_step: int, allow_unverified: bool) -> Path | None:
    """The intact step folder to load, the same on every rank; None if there is none.

    With -1, a corrupt latest checkpoint is skipped with a warning for the one before it (a job killed
    mid-save is the common case, but disks and copies corrupt files too); a chosen step that is corrupt
    is an error, since loading another one silently would not be what was asked. A folder without a manifest
    stops the search: it is refused, or loaded unchecked with `allow_unverified` (`accept_unverified`).
    """
    if load_step != -1:
        step_dir = find_step_dir(folder, load_step)
        require_intact(step_dir, f"checkpoint.load_step = {load_step}", allow_unverified)
        return step_dir
    corrupt = []
    for step in reversed(complete_steps(folder)):
        step_dir = folder / f"step-{step}"
        problems = checkpoint_problems(step_dir)
        if problems is None:
            accept_unverified(step_dir, LATEST, allow_unverified)
            return step_dir
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


def require_intact(step_dir: Path, key: str, allow_unverified: bool) -> None:
    """Raises, naming `key` (the setting that chose the folder) and the bad files, unless `step_dir` is intact, or
    has no manifest and `allow_unverified` accepts it (`accept_unverified`)."""
    problems = checkpoint_problems(step_dir)
    if problems is None:
        accept_unverified(step_dir, key, allow_unverified)
    elif problems:
        raise TorchpreError(
            f"{key}: the checkpoint {step_dir} is corrupt: {'; '.join(problems)}. Load another checkpoint "
            "(checkpoint.load_step = -1 loads the latest intact one) or restore the files."
        )


def check_verifiable(step_dir: Path, key: str, allow_unverified: bool) -> None:
    """Before any work (no process group needed): the error `accept_unverified` would raise when `step_dir` is
    loaded, if it has no manifest and `allow_unverified` is off. The warning of an allowed one is left to the load."""
    if not allow_unverified and not (step_dir / MANIFEST).is_file():
        accept_unverified(step_dir, key, allowed=False)


def accept_unverified(step_dir: Path, key: str, allowed: bool) -> None:
    """For `step_dir`, which has no manifest: a warning naming it when `allowed` (checkpoint.allow_unverified),
    else an error naming it, `key` (the setting that chose it) and that option. A folder without DCP's metadata
    either is no checkpoint at all, which no option makes loadable."""
    if not (step_dir / ".metadata").is_file():
        raise TorchpreError(
            f"{key}: {step_dir} is not a checkpoint: it has neither {MANIFEST} nor torch.distributed.checkpoint's "
            ".metadata. Give a step-N folder that training or `python -m torchpre.convert hf-to-dcp` wrote."
        )
    if not allowed:
        raise TorchpreError(
            f"{key}: the checkpoint {step_dir} has no {MANIFEST}, so its files cannot be checked for damage (every "
            "torchpre save writes one: this folder was written by another tool or before manifests existed, or its "
            f"manifest was removed). Set {ALLOW_UNVERIFIED} = true to load it unchecked, or load another checkpoint."
        )
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.warning(
            "loading %s unchecked: it has no %s (%s = true), so a damaged file in it would go unnoticed",
            step_dir, MANIFEST, ALLOW_UNVERIFIED,
        )  # fmt: skip


def verify_share(step_dir: Path, rank: int, world_size: int) -> list[str]:
    """This rank's share (every world_size-th file of the manifest) of checking `step_dir`: one line per file
    that is missing, has another size or fails its checksum (when the save took checksums), and on rank 0 one
    for a manifest that is missing or not valid."""
    try:
        records = read_manifest(step_dir)
    except TorchpreError as error:
        return [str(error)] if rank == 0 else []
    if records is None:
        return [f"{step_dir / MANIFEST} is missing"] if rank == 0 else []
    expected = sorted(records.items())
    if rank == 0 and any(record.crc32 is None for _, record in expected):
        logger.info(
            'checkpoint %s was saved without checksums (checkpoint.checksums = "off"): only its file sizes are '
            "checked, so altered bytes would go unnoticed",
            step_dir,
        )
    problems = []
    for name, record in expected[rank::world_size]:
        file = step_dir / name
        try:  # an unreadable file is a finding, not an exception: the other ranks wait for this one's answer
            if not file.is_file():
                problems.append(f"{file} is missing")
            elif file.stat().st_size != record.size:
                problems.append(f"{file} has {file.stat().st_size} bytes, not the {record.size} it was saved with")
            elif record.crc32 is not None and _crc32(file) != record.crc32:
                problems.append(f"{file} fails its CRC-32 check (its bytes changed after the save)")
        except OSError as error:
            problems.append(f"{file} cannot be read ({error})")
    return problems


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
