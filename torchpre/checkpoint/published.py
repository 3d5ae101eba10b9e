"""The one life of every folder torchpre publishes: checkpoints (manager.py), Hugging Face exports
(torchpre.interchange.export) and convert's output. Each is written into a new `.tmp-` folder that torchpre marks as
its own (folders.MARKER) before writing anything else, given its final name by one rename once every file is written,
finished in a thread of its own where asked (`Finisher`), and of a job's `step-N` folders the newest keep_latest_k
kept. Whatever removes a `.tmp-` folder, a restart's clean-up or a failed write's, first checks that torchpre made it
(`folders.remove_if_ours`: its name and the marker); one it did not make stays, with a warning.

The names and the marker are folders.py's rules; this module is the sequence over them, so that the three writers
cannot drift apart.
"""

import logging
import re
import secrets
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path
from typing import IO

import torch.distributed as dist

from torchpre.checkpoint.folders import (
    MARKER,
    TMP_PREFIX,
    UNFINISHED,
    complete_steps,
    publish,
    remove_if_ours,
    remove_step,
    remove_unfinished,
    rename_durably,
)
from torchpre.confined import open_new
from torchpre.distributed.process_groups import comm_timeout
from torchpre.errors import UntrustedInput

logger = logging.getLogger("torchpre")

# The names of convert's unfinished outputs: `.tmp-{the output's name}-{12 hex digits}`.
UNFINISHED_OUTPUT = re.compile(r"^\.tmp-.+-[0-9a-f]{12}$")

FileOpener = Callable[[Path], AbstractContextManager[IO[bytes]]]


class StepFolders:
    """A job's `step-N` folders in `folder` (its checkpoints or its exports; `key` is the setting that names the folder,
    `kind` what they are, both for messages), the newest `keep_latest_k` kept (0: all). `keeps_marker`: whether a
    published folder keeps torchpre's marker (a checkpoint lists it in its manifest; a Hugging Face folder holds its
    own files only, and retention marks it again before removing it)."""

    def __init__(self, folder: Path, key: str, kind: str, keep_latest_k: int, keeps_marker: bool):
        self.folder, self.key, self.kind = folder, key, kind
        self.keep_latest_k, self.keeps_marker = keep_latest_k, keeps_marker

    def temporary(self, step: int) -> Path:
        return self.folder / f"{TMP_PREFIX}step-{step}"

    def final(self, step: int) -> Path:
        return self.folder / f"step-{step}"

    def remove_unfinished(self) -> list[Path]:
        """The `.tmp-` folders a crashed run left, and only those torchpre made (`folders.remove_unfinished`)."""
        return remove_unfinished(self.folder)

    def create(self, step: int, open_file: FileOpener = open_new) -> Path:
        """A new `.tmp-step-N` for step's files, marked as torchpre's before anything else is written in it (through
        `open_file`: a checkpoint's recording writer, so that its manifest lists the marker). One in the way that
        torchpre made (a crashed save's) is removed first; one it did not make (a symbolic link, anyone's folder) is
        an UntrustedInput error, and stays. An OSError is the storage's."""
        tmp = self.temporary(step)
        if (tmp.exists() or tmp.is_symlink()) and not remove_if_ours(tmp):
            raise UntrustedInput(
                f"{self.key}: {tmp} is in the way of the {self.kind} of step {step}, and torchpre did not make it (it "
                f"is a symbolic link, or lacks torchpre's marker). Remove it, or point {self.key} at another folder."
            )
        _create_marked(tmp, open_file)
        return tmp

    def publish_or_discard(
        self, tmp: Path, step: int, finalize: Callable[[Path], None], failed: bool
    ) -> OSError | None:
        """Rank 0's end of a save: when a rank `failed`, `tmp` discarded; else `finalize` (a manifest, an index, a
        signature), then the rename that makes `step-N` visible (`folders.publish`). If either of those fails, `tmp`
        is discarded and that OSError returned."""
        if failed:
            self.discard(tmp)
            return None
        try:
            finalize(tmp)
            publish(tmp, self.final(step))
            if not self.keeps_marker:
                (self.final(step) / MARKER).unlink()
        except OSError as error:
            self.discard(tmp)
            return error
        return None

    def discard(self, tmp: Path) -> None:
        """Removes an unfinished save's `tmp`, if there is one and torchpre made it; never raises (the save's own
        failure is the one to report; a restart removes what is left)."""
        _discard(tmp, UNFINISHED)

    def keep_newest(self) -> None:
        """Removes all but the newest keep_latest_k `step-N` (`folders.remove_step`); one that cannot be removed
        stays, with a warning: the save that triggered retention is published already, and no failure."""
        if self.keep_latest_k > 0:
            for step in complete_steps(self.folder)[: -self.keep_latest_k]:
                try:
                    remove_step(self.final(step))
                except (OSError, UntrustedInput) as error:
                    logger.warning("could not remove the old %s step-%d (%s); it stays", self.kind, step, error)


class Finisher:
    """Finishes one save at a time (the end of its write, the manifest, the rename): in a thread of its own when
    `background`, else at once. A finish returns its outcome, or the exception every rank raises: at once, or for one
    in the background at the next `wait` or `close`."""

    def __init__(self, background: bool):
        self._thread = ThreadPoolExecutor(max_workers=1) if background else None
        self._pending: Future[object] | None = None

    def finish(self, function: Callable[..., object], *args: object) -> None:
        if self._thread is None:
            _raise_if_failed(function(*args))
        else:
            self._pending = self._thread.submit(function, *args)

    @property
    def failed(self) -> bool:
        """Whether the save in the background has ended unpublished; never waits."""
        pending = self._pending
        if pending is None or not pending.done():
            return False
        return pending.exception() is not None or isinstance(pending.result(), BaseException)

    def wait(self) -> None:
        """Until the save in the background, if there is one, is finished; raises its failure."""
        pending, self._pending = self._pending, None
        if pending is not None:
            _raise_if_failed(pending.result())

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._thread is not None:
                self._thread.shutdown()


def background_group() -> dist.ProcessGroup:
    """The process group of a writer's background saves, never interleaved with training's collectives: gloo (it must
    not share the training group's stream), or the job's own backend when that is torch's fake one (a dry run), which
    has no peers for gloo to connect to."""
    backend = "fake" if dist.get_backend() == "fake" else "gloo"
    return dist.new_group(backend=backend, timeout=comm_timeout())


def write_whole(target: Path, write: Callable[[Path], None]) -> None:
    """Writes the folder `target` outside a job (convert's output): `write` fills a new marked `.tmp-` folder beside
    it, which is then renamed to `target` (replacing an empty folder there) and loses the marker, so that `target`
    only ever appears complete and holds its own files only. On any failure the temporary folder is discarded."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f"{TMP_PREFIX}{target.name}-{secrets.token_hex(6)}"
    _create_marked(tmp, open_new)
    try:
        write(tmp)
        rename_durably(tmp, target)
    except BaseException:
        _discard(tmp, UNFINISHED_OUTPUT)
        raise
    (target / MARKER).unlink()


def _create_marked(tmp: Path, open_file: FileOpener) -> None:
    tmp.mkdir(parents=True)
    with open_file(tmp / MARKER):
        pass


def _discard(tmp: Path, names: re.Pattern[str]) -> None:
    if not (tmp.exists() or tmp.is_symlink()):
        return
    try:
        remove_if_ours(tmp, names)
    except OSError as error:
        logger.warning("could not remove %s (%s); it stays", tmp, error)


def _raise_if_failed(outcome: object) -> None:
    if isinstance(outcome, BaseException):
        raise outcome
