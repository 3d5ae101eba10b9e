"""Writing into a run folder without ever writing through a link that may lead out of it (docs/security.md).

A file is created with O_EXCL | O_NOFOLLOW under a fresh temporary name and renamed into place, which replaces a
symbolic link at the name instead of writing through it; an existing file is appended to only when it is a regular
file, opened without following a link; a folder torchpre writes into is created, or must already be a folder, never a
link to one.
"""

import errno
import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from torchpre.confined.flags import CLOEXEC, NOFOLLOW, NONBLOCK
from torchpre.errors import UntrustedInput


def write_file(path: Path, data: bytes | str, durable: bool = False) -> None:
    """Replaces `path` with `data` (a str as UTF-8) all at once: a reader sees the old content or the new one. The
    bytes go to a new file of a fresh name beside it (O_EXCL | O_NOFOLLOW), renamed over `path`: a symbolic link
    at `path` is replaced, never written through. `durable` flushes the file to the disk before the rename."""
    with open_replacing(path, durable) as file:
        file.write(data.encode("utf-8") if isinstance(data, str) else data)


@contextmanager
def open_replacing(path: Path, durable: bool = False) -> Iterator[BinaryIO]:
    """A new file, written in pieces by the body, that replaces `path` when the body ends without error, as
    `write_file` replaces it (for content too large to hold twice, such as a token shard)."""
    with _temporary_beside(path) as (file, temporary):
        yield file
        file.flush()
        if durable:
            os.fsync(file.fileno())
        file.close()
        _replace(temporary, path)


@contextmanager
def replacing_path(path: Path) -> Iterator[Path]:
    """The name of a new empty file beside `path`, for a library that writes a file by its name (safetensors, the
    profiler); renamed over `path` when the body ends without error, as `write_file` replaces it."""
    with _temporary_beside(path) as (file, temporary):
        file.close()
        yield temporary
        _replace(temporary, path)


@contextmanager
def _temporary_beside(path: Path) -> Iterator[tuple[BinaryIO, Path]]:
    """A new file beside `path` that no one else can have made (a random name, O_EXCL | O_NOFOLLOW), removed unless
    the body renamed it away."""
    temporary = path.with_name(f".{path.name}.tmp-{secrets.token_hex(6)}")
    file = open_new(temporary)
    try:
        yield file, temporary
    finally:
        file.close()
        if temporary.is_symlink() or temporary.exists():
            temporary.unlink()


def _replace(temporary: Path, path: Path) -> None:
    """`temporary` renamed over `path`; a folder at `path` is an UntrustedInput error naming it, not an OSError."""
    try:
        os.replace(temporary, path)
    except (IsADirectoryError, NotADirectoryError):
        raise UntrustedInput(_not_a_file(path, "a folder")) from None


def open_new(path: Path) -> BinaryIO:
    """`path` created for writing, failing (FileExistsError) if anything, a symbolic link included, is there."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC, 0o644)
    return os.fdopen(fd, "wb")


def open_for_append(path: Path) -> BinaryIO:
    """`path` open for appending (created if missing) when it is a regular file; a symbolic link or anything else
    at `path` is an UntrustedInput error naming it, never written through."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | NOFOLLOW | NONBLOCK | CLOEXEC, 0o644)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.EMLINK):
            raise UntrustedInput(_not_a_file(path, "a symbolic link")) from None
        if error.errno in (errno.EISDIR, errno.ENXIO):  # a folder; a FIFO no one reads
            raise UntrustedInput(_not_a_file(path, "not a regular file")) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UntrustedInput(_not_a_file(path, "not a regular file"))
    os.set_blocking(fd, True)
    return os.fdopen(fd, "ab")


def touch_marker(path: Path) -> None:
    """Creates the empty marker file `path`; one already there is kept if it is a regular file. A symbolic link or
    anything else there is an UntrustedInput error: a marker is never touched through a link."""
    try:
        open_new(path).close()
    except FileExistsError:
        if not is_regular_file(path):
            raise UntrustedInput(_not_a_file(path, "not a regular file (a symbolic link, a folder)")) from None


def make_folder(folder: Path, name: str | PurePosixPath = "") -> Path:
    """`folder/name`, a folder torchpre writes into, created if missing. `folder` (the run's folder, a key of the
    config, an argument) is the caller's choice, and a link there is followed, as is an absolute `name`; each
    component of a relative `name` must be a folder itself: a symbolic link, even to a folder, or a file there is an
    UntrustedInput error naming it, never written through."""
    path = folder / name
    if PurePosixPath(name).is_absolute():
        path.mkdir(parents=True, exist_ok=True)
        return path
    folder.mkdir(parents=True, exist_ok=True)
    current = folder
    for part in PurePosixPath(name).parts:
        current = current / part
        try:
            os.mkdir(current)
        except FileExistsError:
            if not stat.S_ISDIR(os.lstat(current).st_mode):
                what = "a symbolic link" if current.is_symlink() else "not a folder"
                raise UntrustedInput(_not_a_folder(current, what)) from None
    return path


def is_regular_file(path: Path) -> bool:
    """Whether `path` itself is a regular file (a symbolic link, even to a file, is not)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _not_a_file(path: Path, what: str) -> str:
    return (
        f"{path} is {what}, where torchpre writes a file of its own. It never writes through a link, which could lead "
        "out of the folder: remove it, or give the job another folder (docs/security.md)."
    )


def _not_a_folder(path: Path, what: str) -> str:
    return (
        f"{path} is {what}, where torchpre keeps a folder of its own. It never writes through a link, which could "
        "lead out of the run's folder: remove it, or give the job another folder; to keep checkpoints or exports on "
        "another disk, set checkpoint.folder or hf_export.folder to that path (docs/security.md)."
    )
