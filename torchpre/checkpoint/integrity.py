"""Checkpoint integrity: `manifest.json` records every file's size and CRC-32 as a save writes it (storage.py);
loading checks them, so a file truncated or altered after the save is named instead of loaded, and `load_step = -1`
falls back past a corrupt checkpoint, on every rank alike. A step folder without a manifest cannot be checked: it is
refused, naming checkpoint.allow_unverified, which loads it with a warning.

The manifest is {"checksums": "write" | "off", "files": {name: {"size": bytes, "crc32": CRC-32}}}: "crc32" is left
out under "off", and manifests written before checkpoint.checksums existed lack "checksums" (they hold every CRC).

A CRC finds damage, not tampering: anyone can recompute it. With checkpoint.signing_key_file a save also records each
file's SHA-256, the step it saves ("step") and the run it belongs to ("run", run.py), and signs the manifest with
HMAC-SHA256 under that key ("signature"); a load with the key refuses a
folder that is unsigned, signed with another key, whose files do not match their digests, that lies under another
step's name than it was signed as, or (on resume) that belongs to another run (docs/security.md).

Every file is read through `torchpre.confined` (no symbolic link, a regular file), and every file name in a manifest
is a file of its folder (`check_name`); the manifest itself is bounded JSON (`json_input`). A file the manifest does
not list is never read.
"""

import errno
import hashlib
import hmac
import json
import logging
import os
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist

from torchpre.checkpoint.folders import STEP_DIR, complete_steps, find_step_dir, linked_steps
from torchpre.config.job_config import Checkpoint
from torchpre.confined import check_name, file_kind, open_file, read_file, write_file
from torchpre.errors import FieldError, TorchpreError, UntrustedInput, json_field
from torchpre.json_input import JsonValue, read_json

logger = logging.getLogger("torchpre")

MANIFEST = "manifest.json"
ALLOW_UNVERIFIED = "checkpoint.allow_unverified"
SIGNING_KEY = "checkpoint.signing_key_file"
LATEST = "checkpoint.load_step = -1 (the latest checkpoint)"  # the setting that chose the folder, in messages
CHECKSUMS = ("write", "off")
T = TypeVar("T")


@dataclass(frozen=True)
class Trust:
    """What a load accepts: a folder without a manifest (`allow_unverified`, with a warning), and, when
    `signing_key` is set, only manifests signed with it, saved as the step their folder's name says and, when `run`
    is set (a resume from the run's own checkpoint folder), saved by that run."""

    allow_unverified: bool = False
    signing_key: bytes | None = None
    run: str | None = None  # "": the folder names no run, so no checkpoint signed as a run's belongs in it

    @classmethod
    def from_settings(cls, settings: Checkpoint) -> "Trust":
        """The job's [checkpoint] allow_unverified and signing_key_file (read now: a bad key file fails at once)."""
        return cls(settings.allow_unverified, read_signing_key(settings.signing_key_file))


def read_signing_key(path: str) -> bytes | None:
    """The key in the file `path` (checkpoint.signing_key_file; its bytes, surrounding whitespace removed); None
    for ""."""
    if not path:
        return None
    try:
        key = Path(path).read_bytes().strip()
    except OSError as error:
        raise TorchpreError(f"{SIGNING_KEY} = {path!r} cannot be read ({error.strerror}). Give a file holding the "
                            "key (e.g. `openssl rand -hex 32 > key`), readable by every rank.") from None
    if len(key) < 16:
        raise TorchpreError(f"{SIGNING_KEY} = {path!r} holds {len(key)} bytes; a key needs at least 16 "
                            "(e.g. `openssl rand -hex 32 > key`).")
    return key


@dataclass(frozen=True)
class FileRecord:
    """What the manifest says of one file: its size, its CRC-32 unless saved with checksums "off", and its SHA-256
    (hex) when the save was signed."""

    size: int
    crc32: int | None
    sha256: str | None = None


def write_manifest(
    step_dir: Path,
    checksums: str,
    files: dict[str, dict[str, Any]],
    signing_key: bytes | None = None,
    step: int | None = None,
    run: str | None = None,
) -> None:
    """Writes `step_dir`'s manifest (`checksums`: the setting the records were taken under), signed with
    `signing_key` if given (the records then hold SHA-256 digests, and the signature binds `step` and `run`, what
    the folder was saved as, when known), and flushes it to the disk, so that the rename publishing the folder never
    survives a power loss the manifest did not."""
    record: dict[str, Any] = {"checksums": checksums, "files": files}
    if signing_key is not None:
        record |= {"step": step} if step is not None else {}
        record |= {"run": run} if run is not None else {}
        missing = sorted(name for name, entry in files.items() if "sha256" not in entry)
        if missing:
            raise ValueError(f"a signed manifest needs every file's SHA-256; missing for {missing[:3]}")
        record["signature"] = _signature(record, signing_key)
    write_file(step_dir / MANIFEST, json.dumps(record, indent=1, sort_keys=True), durable=True)


def folder_step(step_dir: Path) -> int | None:
    """The step a folder's name says it holds (`step-N`); None for another name."""
    match = STEP_DIR.match(step_dir.name)
    return int(match.group(1)) if match else None


def _signature(record: dict[str, Any], key: bytes) -> str:
    """HMAC-SHA256 of the manifest's records in one canonical JSON form (the signature itself left out)."""
    signed = {name: value for name, value in record.items() if name != "signature"}
    text = json.dumps(signed, sort_keys=True, separators=(",", ":"))
    return hmac.new(key, text.encode("utf-8"), hashlib.sha256).hexdigest()


def read_manifest(
    step_dir: Path, signing_key: bytes | None = None, run: str | None = None
) -> dict[str, FileRecord] | None:
    """`step_dir`'s file records by name, every field checked; None when it has no manifest. A manifest that is a
    link, does not parse, lacks a key, holds a value of the wrong type or names a file outside the folder raises a
    TorchpreError naming the file and the key; with `signing_key`, so does one that is unsigned, signed with another
    key, signed as another step than the folder's name says, or (with `run`) saved by another run."""
    if file_kind(step_dir, MANIFEST) == "missing":
        return None
    path = step_dir / MANIFEST
    try:
        record = read_json(step_dir, MANIFEST, "manifest")
    except UntrustedInput as error:
        raise TorchpreError(f"{path} is not a valid manifest: {error}") from None
    try:
        checksums = json_field(record, "checksums", str, default="write")
        if checksums not in CHECKSUMS:
            raise FieldError(f"'checksums' is {checksums!r}, not 'write' or 'off'")
        files = json_field(record, "files", dict)
        records = {name: _file_record(files, name, checksums == "write") for name in sorted(files)}
        signature = json_field(record, "signature", str, default=None)
        saved_step = json_field(record, "step", int, default=None)
        if saved_step is not None and saved_step < 0:
            raise FieldError(f"'step' is {saved_step}, not a step number")
        saved_run = json_field(record, "run", str, default=None)
    except FieldError as error:
        raise TorchpreError(f"{path} is not a valid manifest ({error})") from None
    for name in records:
        check_name(name, path, f"files[{name!r}]")
    if signing_key is not None:
        _require_signed(path, record, signature, signing_key, records)
        _require_bound(path, folder_step(step_dir), saved_step, run, saved_run)
    return records


def _require_bound(
    path: Path, step: int | None, saved_step: int | None, run: str | None, saved_run: str | None
) -> None:
    """Raises unless a signed manifest was saved as `step` (the folder's name; None: any) by `run` (None: any)."""
    if step is not None and saved_step is None:
        why = "its signature does not bind the step it was saved as (a torchpre from before 2026-12-07 signed it)"
    elif step is not None and saved_step != step:
        why = f"it was signed as step {saved_step}, but lies in {path.parent.name}: it was copied or renamed"
    elif run == "" and saved_run is not None:
        why = f"it was saved by run {saved_run}, but its folder has no run.json naming the run its checkpoints are"
    elif run is not None and saved_run != run:
        why = (
            f"it was saved by run {saved_run}, not by this folder's run {run} (its run.json): it was copied in from "
            "another run"
        )
    else:
        return
    raise UntrustedInput(
        f"{path}: {why}, and {SIGNING_KEY} asks for checkpoints signed with its key as what they are. Load the "
        "checkpoint under the name and in the folder it was saved in (checkpoint.initial_load_path takes another "
        "run's weights), or leave the key unset to trust this folder without proof (docs/security.md)."
    )


def _require_signed(
    path: Path, record: dict[str, Any], signature: str | None, key: bytes, records: dict[str, FileRecord]
) -> None:
    if signature is None:
        why = "it is not signed"
    elif not hmac.compare_digest(signature, _signature(record, key)):
        why = "its signature does not match this key: it was signed with another key, or altered after the save"
    elif any(entry.sha256 is None for entry in records.values()):
        why = "it lacks a file's SHA-256"
    else:
        return
    raise TorchpreError(
        f"{path}: {why}, and {SIGNING_KEY} asks for checkpoints signed with its key. Load a checkpoint saved with "
        "that key, or leave the key unset to trust this folder's files without proof of who wrote them "
        "(docs/security.md)."
    )


def _file_record(files: dict[str, JsonValue], name: str, with_crc: bool) -> FileRecord:
    record, where = files[name], f"files.{name}"
    size = json_field(record, "size", int, where)
    if size < 0:
        raise FieldError(f"'{where}.size' is {size}, not a size in bytes")
    crc = json_field(record, "crc32", int, where) if with_crc else json_field(record, "crc32", int, where, None)
    return FileRecord(size, crc, json_field(record, "sha256", str, where, None))


def checkpoint_problems(step_dir: Path, trust: Trust = Trust()) -> list[str] | None:
    """Every file of `step_dir` that does not match its manifest; None when it has no manifest to check against.
    Under a process group each rank checks a share and all get all; without one (convert) this process checks
    every file."""
    if file_kind(step_dir, MANIFEST) == "missing":
        return None
    if not dist.is_initialized():
        return verify_share(step_dir, 0, 1, trust)
    share = verify_share(step_dir, dist.get_rank(), dist.get_world_size(), trust)
    return sorted(problem for part in all_gather(share) for problem in part)


def find_intact_step(folder: Path, load_step: int, trust: Trust) -> Path | None:
    """The intact step folder to load, the same on every rank; None if there is none.

    With -1, a corrupt latest checkpoint (or, under a signing key, one not signed with it, or a `step-N` that is a
    symbolic link) is skipped with a warning for the one before it (a job killed mid-save is the common case, but
    disks and copies corrupt files too); a chosen step that is corrupt is an error, since loading another one silently
    would not be what was asked. A folder without a manifest stops the search: it is refused, or loaded unchecked with
    `trust.allow_unverified` (`accept_unverified`).
    """
    if load_step != -1:
        step_dir = find_step_dir(folder, load_step)
        require_intact(step_dir, f"checkpoint.load_step = {load_step}", trust)
        return step_dir
    corrupt = []
    linked = linked_steps(folder)
    for step in sorted({*complete_steps(folder), *linked}, reverse=True):
        step_dir = folder / f"step-{step}"
        if step in linked:
            problems = [f"{step_dir} is a symbolic link, which may lead to another run's checkpoint"]
        else:
            problems = checkpoint_problems(step_dir, trust)
        if problems is None:
            accept_unverified(step_dir, LATEST, trust)
            return step_dir
        if not problems:
            return step_dir
        corrupt.append(f"{step_dir} ({_joined(problems)})")
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.warning("checkpoint %s is corrupt: %s. Trying the one before it.", step_dir, _joined(problems))
    if corrupt:
        raise TorchpreError(
            f"Every checkpoint in {folder} is corrupt: {'; '.join(corrupt)}. Restore the files, or move the "
            "folder away (or set checkpoint.folder elsewhere) to start from scratch."
        )
    return None


def require_intact(step_dir: Path, key: str, trust: Trust) -> None:
    """Raises, naming `key` (the setting that chose the folder) and the bad files, unless `step_dir` is intact, or
    has no manifest and `trust.allow_unverified` accepts it (`accept_unverified`)."""
    problems = checkpoint_problems(step_dir, trust)
    if problems is None:
        accept_unverified(step_dir, key, trust)
    elif problems:
        raise TorchpreError(
            f"{key}: the checkpoint {step_dir} is corrupt: {_joined(problems)}. Load another checkpoint "
            "(checkpoint.load_step = -1 loads the latest intact one) or restore the files."
        )


def _joined(problems: list[str]) -> str:
    return "; ".join(problem.rstrip(".") for problem in problems)


def check_verifiable(step_dir: Path, key: str, trust: Trust) -> None:
    """Before any work (no process group needed): the error `accept_unverified` would raise when `step_dir` is
    loaded, if it has no manifest and `trust` does not accept that. The warning of an allowed one is left to the
    load, and so is checking the files (and a signature): a latest checkpoint that fails is skipped there."""
    if file_kind(step_dir, MANIFEST) == "missing" and (not trust.allow_unverified or trust.signing_key is not None):
        accept_unverified(step_dir, key, trust)


def accept_unverified(step_dir: Path, key: str, trust: Trust) -> None:
    """For `step_dir`, which has no manifest: a warning naming it when `trust.allow_unverified`
    (checkpoint.allow_unverified), else an error naming it, `key` (the setting that chose it) and that option. A
    folder without DCP's metadata either is no checkpoint at all, which no option makes loadable, and under a
    signing key no unsigned folder loads."""
    if file_kind(step_dir, ".metadata") == "missing":
        raise TorchpreError(
            f"{key}: {step_dir} is not a checkpoint: it has neither {MANIFEST} nor torch.distributed.checkpoint's "
            ".metadata. Give a step-N folder that training or `python -m torchpre.convert hf-to-dcp` wrote."
        )
    if trust.signing_key is not None:
        raise TorchpreError(
            f"{key}: the checkpoint {step_dir} has no {MANIFEST}, so it is not signed, and {SIGNING_KEY} asks for "
            "checkpoints signed with its key. Load a checkpoint saved with that key (docs/security.md)."
        )
    if not trust.allow_unverified:
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


def verify_share(step_dir: Path, rank: int, world_size: int, trust: Trust = Trust()) -> list[str]:
    """This rank's share (every world_size-th file of the manifest) of checking `step_dir`: one line per file
    that is missing, has another size or fails its checksum or digest, and on rank 0 one for a manifest that is
    missing, not valid, or (under a signing key) not signed with it."""
    try:
        records = read_manifest(step_dir, trust.signing_key, trust.run)
    except TorchpreError as error:
        return [str(error)] if rank == 0 else []
    if records is None:
        return [f"{step_dir / MANIFEST} is missing"] if rank == 0 else []
    expected = sorted(records.items())
    if rank == 0 and any(record.crc32 is None and record.sha256 is None for _, record in expected):
        logger.info(
            'checkpoint %s was saved without checksums (checkpoint.checksums = "off"): only its file sizes are '
            "checked, so altered bytes would go unnoticed",
            step_dir,
        )
    problems = [file_problem(step_dir, name, record) for name, record in expected[rank::world_size]]
    return [problem for problem in problems if problem is not None]


def file_problem(folder: Path, name: str, record: FileRecord) -> str | None:
    """What is wrong with `folder/name` against its manifest record, or None; its digests are taken from the file
    `confined.open_file` opened (no link, a regular file), as it is read once. An unreadable file is a finding, not
    an exception: under a process group the other ranks wait for this one's answer."""
    file = folder / name
    try:
        with open_file(folder, name) as stream:
            size = os.fstat(stream.fileno()).st_size
            if size != record.size:
                return f"{file} has {size} bytes, not the {record.size} it was saved with"
            if record.sha256 is None and record.crc32 is None:
                return None
            crc, sha = 0, hashlib.sha256() if record.sha256 is not None else None
            while chunk := stream.read(1 << 24):
                crc = zlib.crc32(chunk, crc)
                if sha is not None:
                    sha.update(chunk)
    except FileNotFoundError:
        return f"{file} is missing"
    except UntrustedInput:
        kind = "a symbolic link" if file_kind(folder, name) == "link" else "no regular file"
        return f"{file} is {kind}, not a saved file"
    except OSError as error:
        return f"{file} cannot be read ({error})"
    return _digest_problem(file, record, crc, None if sha is None else sha.hexdigest())


def file_record(path: Path) -> dict[str, int | str]:
    """The manifest record of the regular file `path` as a signed save writes it: size, CRC-32, SHA-256."""
    crc, sha, size = 0, hashlib.sha256(), 0
    with open_file(path.parent, path.name) as stream:
        while chunk := stream.read(1 << 24):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
            sha.update(chunk)
    return {"size": size, "crc32": crc, "sha256": sha.hexdigest()}


def _digest_problem(file: Path, record: FileRecord, crc: int, sha256: str | None) -> str | None:
    if record.sha256 is not None and sha256 != record.sha256:
        return f"{file} fails its SHA-256 check (its bytes changed after the save)"
    if record.crc32 is not None and crc != record.crc32:
        return f"{file} fails its CRC-32 check (its bytes changed after the save)"
    return None


@dataclass
class FileCheck:
    """Checks files of `step_dir` against its manifest before a reader uses them: `require` raises, naming the
    file, unless it matches its record, and `read` returns a small file's bytes checked as they were read (one open,
    one read). A file the manifest does not list is never read; a folder without a manifest is read only if
    `trust.allow_unverified`. `whole_folder_checked` records that every listed file was just checked (the
    collective check of all files), so `require` checks no listed file again."""

    step_dir: Path
    trust: Trust = Trust()
    key: str = ""  # the setting that chose the folder, in messages
    _checked: set[str] = field(default_factory=set)
    _records: dict[str, FileRecord] | None = None
    _read: bool = False
    _whole: bool = False

    def whole_folder_checked(self) -> "FileCheck":
        self._whole = True
        return self

    def require(self, name: str) -> None:
        if name in self._checked:
            return
        record = self._record(name)
        if record is not None and not self._whole:
            self._raise_if(file_problem(self.step_dir, name, record))
        self._checked.add(name)

    def require_all(self, names: Iterable[str]) -> None:
        for name in sorted(set(names)):
            self.require(name)

    def read(self, name: str, limit: int) -> bytes:
        """The bytes of the folder's file `name` (at most `limit`; FileNotFoundError when it is missing), checked
        against the manifest's record as they were read."""
        if file_kind(self.step_dir, name) == "missing":
            raise FileNotFoundError(errno.ENOENT, "No such file", str(self.step_dir / name))
        record = self._record(name)
        data = read_file(self.step_dir, name, limit)
        if record is not None:
            if len(data) != record.size:
                self._raise_if(f"{self.step_dir / name} has {len(data)} bytes, not the {record.size} it was saved with")
            sha = hashlib.sha256(data).hexdigest() if record.sha256 is not None else None
            self._raise_if(_digest_problem(self.step_dir / name, record, zlib.crc32(data), sha))
        self._checked.add(name)
        return data

    def records(self) -> dict[str, FileRecord] | None:
        """The manifest's records, read once; None for a folder without a manifest (which `trust` accepts)."""
        if not self._read:
            self._records, self._read = read_manifest(self.step_dir, self.trust.signing_key, self.trust.run), True
            if self._records is None and not self._whole:  # the whole folder's check accepted it, with its warning
                accept_unverified(self.step_dir, self.key, self.trust)
        return self._records

    def _record(self, name: str) -> FileRecord | None:
        """`name`'s manifest record; None when the folder has no manifest (and may be read unchecked)."""
        records = self.records()
        if records is None:
            return None
        if name not in records:
            self._raise_if(f"{self.step_dir / name} is not in its {MANIFEST}")
        return records[name]

    def _raise_if(self, problem: str | None) -> None:
        if problem:
            setting = f"{self.key}: " if self.key else ""
            raise TorchpreError(
                f"{setting}the checkpoint {self.step_dir} is corrupt: {problem}. Load another checkpoint or "
                "restore the files; a file the manifest does not vouch for is never read."
            )


def all_gather(value: T, group: dist.ProcessGroup | None = None) -> list[T]:
    """Every rank's `value` (of `group`), by rank."""
    gathered = [value] * dist.get_world_size(group)  # each item replaced by its rank's
    dist.all_gather_object(gathered, value, group=group)
    return gathered
