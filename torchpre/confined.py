"""File names that come from inside a file (a checkpoint's metadata or manifest, a Hugging Face index, a shard
manifest) name files of that file's own folder, and nothing else: a bare name, no `..`, no absolute path, and no
symbolic link that leads out of the folder. Whoever wrote the file may not be whoever loads it (docs/security.md).
"""

from pathlib import Path, PurePosixPath, PureWindowsPath

from torchpre.errors import UntrustedInput


def confined_path(folder: Path, name: object, source: Path, entry: str) -> Path:
    """`folder / name`, once `name` is shown to be a file name inside `folder`; otherwise an UntrustedInput error naming
    `source` (the file that holds the name), `entry` (where in it) and the name.

    A name may have subfolders ("sub/x.bin") but no part that climbs (`..`), no root or drive, no backslash, and
    must not resolve, through symbolic links, to a place outside the folder's own resolved path."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise _escape(source, entry, name, "is not a file name")
    parts = PurePosixPath(name).parts
    if name.startswith("/") or PureWindowsPath(name).drive or "\\" in name:
        raise _escape(source, entry, name, "is an absolute path")
    if ".." in parts:
        raise _escape(source, entry, name, "climbs out of the folder with '..'")
    path = folder / name
    root = folder.resolve()
    if not path.resolve().is_relative_to(root):
        raise _escape(source, entry, name, f"leads through a symbolic link to {path.resolve()}, outside {root}")
    return path


def _escape(source: Path, entry: str, name: object, why: str) -> UntrustedInput:
    return UntrustedInput(
        f"{source}: {entry} names {name!r}, which {why}. A file may only name files inside its own folder "
        f"({source.parent}); this one was written by another tool or altered. Do not load it, or fix the entry "
        "(docs/security.md)."
    )
