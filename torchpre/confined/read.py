"""Reading a file in a folder someone else may have made without ever reaching outside it (docs/security.md).

A name that comes from inside a file (a checkpoint's metadata or manifest, a Hugging Face index, a shard manifest) must
be a relative name with no `..`, no root and no backslash (`check_name`); the file is then opened relative to the
folder without following a symbolic link on any component of the name (`openat2` with RESOLVE_BENEATH |
RESOLVE_NO_SYMLINKS where the kernel has it, O_NOFOLLOW component by component otherwise), and must be a regular file
on the open descriptor, so that what is checked is what is read. The folder itself is the caller's choice (a key of
the config, an argument): a link there is followed. One link inside a folder is followed, by its form: a
huggingface_hub cache snapshot's link into its repository's blobs (`located`). A file the user names (`open_named`,
`read_named`) may be reached through links, the user's choice, but must be a regular file too.
"""

import ctypes
import errno
import os
import re
import stat
import sys
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import BinaryIO, Literal

from torchpre.confined.flags import CLOEXEC, DIRECTORY, NOFOLLOW, NONBLOCK
from torchpre.errors import UntrustedInput

_RESOLVE_NO_MAGICLINKS, _RESOLVE_NO_SYMLINKS, _RESOLVE_BENEATH = 0x02, 0x04, 0x08
_SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437, "arm64": 437, "ppc64le": 437, "s390x": 437}


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


class _Openat2:
    """Linux's openat2(2) through libc's syscall(); `available` is False on other systems, on kernels before 5.6 and
    where a sandbox (seccomp) refuses it, and `open_beneath` then walks the name one component at a time."""

    def __init__(self) -> None:
        self.available = False
        number = _SYS_OPENAT2.get(os.uname().machine) if sys.platform == "linux" else None
        if number is None:
            return
        try:
            self._syscall = ctypes.CDLL(None, use_errno=True).syscall
        except (OSError, AttributeError):
            return
        self._number = number
        probe = os.open(".", os.O_RDONLY | DIRECTORY | CLOEXEC)
        try:
            fd = self(probe, ".", os.O_RDONLY | DIRECTORY)
            os.close(fd)
            self.available = True
        except OSError:
            pass
        finally:
            os.close(probe)

    def __call__(self, dir_fd: int, name: str, flags: int, mode: int = 0) -> int:
        mode = mode if flags & (os.O_CREAT | getattr(os, "O_TMPFILE", 0)) else 0  # openat2 refuses a mode otherwise
        how = _OpenHow(flags | CLOEXEC, mode, _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS)
        fd = self._syscall(self._number, dir_fd, os.fsencode(name), ctypes.byref(how), ctypes.sizeof(how))
        if fd < 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code), name)
        return fd


_openat2 = _Openat2()


def openat2_available() -> bool:
    """Whether this process opens beneath a folder with openat2 (else component by component with O_NOFOLLOW)."""
    return _openat2.available


_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def check_name(name: object, source: Path, entry: str) -> str:
    """`name` (a file name read from the file `source`, at `entry`) once shown to name a file inside its folder: a
    non-empty string with no NUL, no root or drive, no backslash and no `..` part. Otherwise an UntrustedInput error
    naming `source`, `entry` and the name. Whether the file is reached without a symbolic link is for `open_file`."""
    if isinstance(name, str) and _PLAIN_NAME.fullmatch(name) and name != "..":
        return name  # one component of plain characters: the checks below pass (a manifest lists 100,000 of them)
    if not isinstance(name, str) or not name or "\x00" in name:
        raise _escape(source, entry, name, "is not a file name")
    if name.startswith("/") or PureWindowsPath(name).drive or "\\" in name:
        raise _escape(source, entry, name, "is an absolute path")
    if ".." in PurePosixPath(name).parts:
        raise _escape(source, entry, name, "climbs out of the folder with '..'")
    return name


def confined_path(folder: Path, name: object, source: Path, entry: str) -> Path:
    """`folder / name` once `check_name` accepts `name` and the file it names is not reached through a symbolic link
    (it may be missing: the caller reports that); an UntrustedInput error naming `source` and `entry` otherwise."""
    checked = check_name(name, source, entry)
    if file_kind(folder, checked) == "link":
        raise _escape(source, entry, name, "is, or leads through, a symbolic link")
    return folder / checked


FileKind = Literal["file", "missing", "link", "other"]


def file_kind(folder: Path, name: str) -> FileKind:
    """What `folder/name` is, without following a symbolic link on any component of `name`: a regular file, missing,
    a link (or a path through one), or something else (a folder, a FIFO, a device)."""
    try:
        fd = open_beneath(folder, name, os.O_PATH if hasattr(os, "O_PATH") else os.O_RDONLY | NONBLOCK)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.EXDEV, errno.EMLINK):
            return "link"
        if error.errno == errno.ENOTDIR and _a_component_is_a_link(folder, name):
            return "link"
        return "missing" if error.errno in (errno.ENOENT, errno.ENOTDIR) else "other"
    try:
        mode = os.fstat(fd).st_mode
        return "file" if stat.S_ISREG(mode) else "link" if stat.S_ISLNK(mode) else "other"
    finally:
        os.close(fd)


def _a_component_is_a_link(folder: Path, name: str) -> bool:
    path = folder
    for part in PurePosixPath(name).parts:
        path = path / part
        if path.is_symlink():
            return True
    return False


# huggingface_hub's cache keeps a released folder as `<repo>/snapshots/<revision>/`, each file of it a link into the
# repository's content-addressed `<repo>/blobs/<hash>`: `../../blobs/<hash>`, one more `../` per subfolder of the name.
_HUB_BLOB = re.compile(r"((?:\.\./)+)blobs/([0-9a-f]{40,64})")


def located(folder: Path, name: str) -> tuple[Path, str]:
    """Where `folder/name` is read from: itself, or for a file of a huggingface_hub cache snapshot, the blob its link
    names, as (folder, name) for `open_file`. Only a link of exactly that form is located (from a
    `snapshots/<revision>` folder into its own repository's `blobs` folder, which `open_file` then reads without
    following a link); any other link is left for the open to refuse."""
    if folder.parent.name != "snapshots":
        return folder, name
    try:
        target = os.readlink(folder / name)
    except OSError:  # not a link, or missing: the open says which
        return folder, name
    match = _HUB_BLOB.fullmatch(target)
    if match is None or match.group(1).count("../") != len(PurePosixPath(name).parts) + 1:
        return folder, name
    return folder.parent.parent / "blobs", match.group(2)


class OpenFolder:
    """A folder resolved once and held open (one descriptor) while many of its files are opened relative to it
    (`open_file(OpenFolder(...), name)`): a shard folder of 100,000 files is not looked up again for each, and a
    folder renamed or replaced by a link after it was opened is not followed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | DIRECTORY | CLOEXEC)

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        self.close()


def open_beneath(folder: Path | str | OpenFolder, name: str, flags: int, mode: int = 0o644) -> int:
    """A descriptor of `folder/name` opened with `flags`, no component of `name` followed if it is a symbolic link
    (OSError ELOOP, EXDEV or ENOTDIR then). `folder` itself is opened as given, or is an `OpenFolder` already open."""
    if isinstance(folder, OpenFolder):
        return _open_at(folder.fd, name, flags, mode)
    dir_fd = os.open(folder, os.O_RDONLY | DIRECTORY | CLOEXEC)
    try:
        return _open_at(dir_fd, name, flags, mode)
    finally:
        os.close(dir_fd)


def _open_at(dir_fd: int, name: str, flags: int, mode: int) -> int:
    if _openat2.available:
        return _openat2(dir_fd, name, flags, mode)
    return _open_by_components(dir_fd, name, flags, mode)


def _open_by_components(dir_fd: int, name: str, flags: int, mode: int) -> int:
    parts = [part for part in PurePosixPath(name).parts if part != "."]
    if not parts or ".." in parts or name.startswith("/"):
        raise OSError(errno.EXDEV, "leaves the folder", name)
    current = os.dup(dir_fd)
    try:
        for part in parts[:-1]:
            following = os.open(part, os.O_RDONLY | DIRECTORY | NOFOLLOW | CLOEXEC, dir_fd=current)
            os.close(current)
            current = following
        return os.open(parts[-1], flags | NOFOLLOW | CLOEXEC, mode, dir_fd=current)
    finally:
        os.close(current)


def open_file(folder: Path | OpenFolder, name: str, source: Path | None = None, entry: str = "") -> BinaryIO:
    """`folder/name` open for reading, once shown to be a regular file reached without a symbolic link; `name` is
    checked by `check_name` when it comes from inside the file `source` (at `entry`). `folder` may be an `OpenFolder`,
    resolved once for all its files. A missing file raises
    FileNotFoundError (the caller knows what its absence means); a link or something other than a file raises an
    UntrustedInput error naming the path."""
    if source is not None:
        check_name(name, source, entry)
    path = folder / name
    try:
        fd = open_beneath(folder, name, os.O_RDONLY | NONBLOCK)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.EXDEV, errno.EMLINK) or (
            error.errno == errno.ENOTDIR and _a_component_is_a_link(folder, name)
        ):
            raise UntrustedInput(_link_message(path, source, entry)) from None
        if error.errno in (errno.ENOENT, errno.ENOTDIR):
            raise FileNotFoundError(errno.ENOENT, "No such file", str(path)) from None
        raise
    return _regular(fd, path)


def open_named(path: Path) -> BinaryIO:
    """A file the user named (a key of the config, an argument) open for reading. Links on its path are the user's
    choice and followed, but what it leads to must be a regular file (a FIFO would block the job, a device never
    ends): an UntrustedInput error names it otherwise; FileNotFoundError when it is missing."""
    try:
        fd = os.open(path, os.O_RDONLY | NONBLOCK | CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(errno.ENOENT, "No such file", str(path)) from None
    except IsADirectoryError:
        raise UntrustedInput(f"{path} is a folder; torchpre reads only regular files.") from None
    return _regular(fd, path)


def _regular(fd: int, path: Path) -> BinaryIO:
    """The open descriptor `fd` of `path` as a blocking binary file, once shown to be a regular file (else closed)."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        kind = "a folder" if stat.S_ISDIR(info.st_mode) else "not a regular file"
        raise UntrustedInput(f"{path} is {kind}; torchpre reads only regular files from a folder it is given.")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_file(folder: Path, name: str, limit: int, source: Path | None = None, entry: str = "") -> bytes:
    """The bytes of `folder/name`, opened as `open_file` opens it, refused (UntrustedInput naming the path) when it
    holds more than `limit` bytes: files of records (JSON, metadata) are bounded before they are parsed."""
    with open_file(folder, name, source, entry) as file:
        return _bounded(file, folder / name, limit)


def read_named(path: Path, limit: int) -> bytes:
    """The bytes of the file the user named `path`, opened as `open_named` opens it, bounded as `read_file`'s."""
    with open_named(path) as file:
        return _bounded(file, path, limit)


def _bounded(file: BinaryIO, path: Path, limit: int) -> bytes:
    size = os.fstat(file.fileno()).st_size
    if size > limit:
        raise UntrustedInput(too_large(path, size, limit))
    data = file.read(limit + 1)
    if len(data) > limit:  # it grew while read
        raise UntrustedInput(too_large(path, len(data), limit))
    return data


def too_large(path: Path, size: int, limit: int) -> str:
    return (
        f"{path} holds {size:,} bytes; a file of this kind holds at most {limit:,}. It was not written by torchpre "
        "or its peers, or was altered (docs/security.md)."
    )


def _link_message(path: Path, source: Path | None, entry: str) -> str:
    named = f" (named by {source}, {entry})" if source is not None else ""
    return (
        f"{path}{named} is, or leads through, a symbolic link. torchpre reads only the files of the folder it was "
        "given, never a link that may lead out of it; this folder was written by another tool or altered. Copy the "
        "real file in its place, or load another folder (docs/security.md)."
    )


def _escape(source: Path, entry: str, name: object, why: str) -> UntrustedInput:
    return UntrustedInput(
        f"{source}: {entry} names {name!r}, which {why}. A file may only name files inside its own folder "
        f"({source.parent}); this one was written by another tool or altered. Do not load it, or fix the entry "
        "(docs/security.md)."
    )
