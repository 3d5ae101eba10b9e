"""What a save asks of its file system: room for the checkpoint, checked before writing, and a write that failed
anyway described for the person running the job: where, how many bytes it needed and had, and what to do."""

import errno
import shutil
from pathlib import Path
from typing import NamedTuple

from torch.distributed.checkpoint.api import CheckpointException

# What an errno means for a save, and what to do about it.
_NO_ROOM = (
    "free space there, or point checkpoint.folder at a file system with room (checkpoint.keep_latest_k bounds how "
    "many checkpoints are kept)"
)
_CAUSES = {
    errno.ENOSPC: ("no space left on the device", _NO_ROOM),
    errno.EDQUOT: ("the disk quota is exhausted", _NO_ROOM),
    errno.EACCES: ("permission denied", "make the folder writable for this user, or point checkpoint.folder elsewhere"),
    errno.EPERM: ("operation not permitted", "make the folder writable for this user, or point checkpoint.folder "
                  "elsewhere"),
    errno.EROFS: ("the file system is read-only", "point checkpoint.folder at a writable file system"),
    errno.EIO: ("an I/O error (the disk or its network storage is failing)",
                "check the storage (the kernel log, the file server), or point checkpoint.folder elsewhere"),
}  # fmt: skip


def free_bytes(folder: Path) -> int:
    """Bytes this user may still write on the file system of `folder` (or of its nearest existing parent)."""
    existing = next(path for path in (folder, *folder.parents) if path.exists())
    return shutil.disk_usage(existing).free


class Failure(NamedTuple):
    """One rank's failed save, small enough to gather: whether an OSError was behind it (the storage is to blame),
    its errno, and one line that says what happened."""

    storage: bool
    errno: int | None
    line: str


def os_error(error: BaseException) -> OSError | None:
    """The OSError behind a failed save, if any: the error itself, one of the ranks' failures that DCP's
    CheckpointException carries, or the cause or context of either. A connection's errors are OSErrors too, but
    they are a peer's or the network's, not the storage's."""
    seen: set[int] = set()
    pending = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and not isinstance(current, (ConnectionError, TimeoutError)):
            return current
        if isinstance(current, CheckpointException):
            pending.extend(failure for failure, _ in current.failures.values())
        pending.extend((current.__cause__, current.__context__))
    return None


def summary(error: BaseException) -> Failure:
    """What a failed save met, on this rank."""
    cause = os_error(error)
    if cause is not None:
        return Failure(True, cause.errno, _first_line(cause))
    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    return Failure(False, None, _first_line(error))


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def unwritten_message(
    step: int, folder: Path, failures: dict[int, Failure], needed: int, free: int, latest: Path | None
) -> str | None:
    """The paragraph for a save that failed on the ranks of `failures`, or None when the storage is not to blame
    (a bug): no rank met an OSError, and the file system has room for the `needed` bytes (`free` is measured after
    the failed save's folder was removed). `latest` is the checkpoint a rerun resumes from."""
    storage = [failure for failure in failures.values() if failure.storage]
    if not storage and free >= needed:
        return None
    # Without an OSError but short of room: a short write on a full disk that the writer did not report as one.
    code = storage[0].errno if storage else errno.ENOSPC
    fallback = (storage[0].line if storage else "", "check the storage, or point checkpoint.folder elsewhere")
    what, remedy = _CAUSES.get(code, fallback)
    ranks = ", ".join(f"rank {rank}: {failure.line}" for rank, failure in sorted(failures.items()))
    resume = f"resume from {latest}" if latest is not None else "start over (there is no earlier checkpoint)"
    return (
        f"the checkpoint of step {step} could not be written to {folder}: {what} ({ranks}). It needs about "
        f"{needed:,} bytes; the file system has {free:,} bytes free now that the unfinished "
        f"{folder / f'.tmp-step-{step}'} is removed, and the earlier checkpoints are kept. To go on, {remedy}, then "
        f"run the same command again to {resume}."
    )


def low_space_message(step: int, folder: Path, needed: int, free: int, estimate: str) -> str:
    """The start of the warning (or error, when the save is skipped) before a save that will not fit."""
    return (
        f"the checkpoint of step {step} will not fit in {folder}: it takes about {needed:,} bytes ({estimate}), and "
        f"the file system has {free:,} bytes free"
    )
