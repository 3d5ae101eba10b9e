"""When a save becomes a checkpoint, without a training job: an async save is published (manifest, rename to
step-N) as soon as its write is done, never before and not at the next save; a save the storage cannot take leaves
no folder, keeps the earlier checkpoints and raises one StorageError that says where, how many bytes and what to
do, and removes no folder torchpre did not make; a save that will not fit in the free space is warned about or
skipped (checkpoint.on_low_space)."""

import dataclasses
import errno
import io
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem

import torchpre.checkpoint.manager as manager
from tests.unit.test_checkpoint_integrity import _loaded_step, _manager, _records_on_disk
from torchpre.checkpoint.disk import Failure, summary
from torchpre.checkpoint.folders import MARKER
from torchpre.checkpoint.integrity import MANIFEST
from torchpre.checkpoint.storage import RecordingWriter
from torchpre.errors import StorageError


def _wait_for(condition: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "waited in vain"
        time.sleep(0.01)


def test_an_async_save_is_published_when_its_write_is_done_not_before_and_not_at_the_next_save(
    world, tmp_path, monkeypatch
):
    """The write's last file (DCP's .metadata) is held back: while it is, nothing is published; once it is
    written, step-2 appears with a manifest of every file, though nothing waits for the save; the metrics report
    it once, with the seconds from the save's start to its publication."""
    written = threading.Event()
    finish = RecordingWriter.finish

    def held_finish(self, *args, **kwargs):
        assert written.wait(timeout=30)
        return finish(self, *args, **kwargs)

    monkeypatch.setattr(RecordingWriter, "finish", held_finish)
    checkpoints = _manager(tmp_path, async_mode="async")
    checkpoints.components["train"].values["step"] = 2
    checkpoints.save(2)
    time.sleep(0.5)  # the finisher runs in the background: had it not waited for the write, it would be done by now
    assert sorted(path.name for path in tmp_path.iterdir()) == [".tmp-step-2"]
    assert not checkpoints.failed and checkpoints.metrics() == {}
    written.set()
    _wait_for(lambda: (tmp_path / "step-2").is_dir())  # no save, wait or close asked for it
    step_dir = tmp_path / "step-2"
    files = json.loads((step_dir / MANIFEST).read_text())["files"]
    assert files == _records_on_disk(step_dir) and ".metadata" in files
    reported: list[dict[str, float]] = []
    _wait_for(lambda: reported.append(checkpoints.metrics()) or reported[-1])  # set once every rank knows
    assert reported[-1]["checkpoint/published_step"] == 2 and 0.5 <= reported[-1]["checkpoint/write_s"] < 30
    assert checkpoints.metrics() == {}  # reported once
    checkpoints.close()
    assert _loaded_step(_manager(tmp_path), step_dir) == 2


def test_a_sync_save_is_reported_in_the_next_record_too(world, tmp_path):
    checkpoints = _manager(tmp_path)
    assert checkpoints.save(2)
    assert set(checkpoints.metrics()) == {"checkpoint/published_step", "checkpoint/write_s"}


class _FailingFile(io.BytesIO):
    def __init__(self, code: int) -> None:
        super().__init__()
        self.code = code

    def write(self, data) -> int:
        raise OSError(self.code, os.strerror(self.code))


def _failing_storage(monkeypatch, name_suffix: str, code: int) -> None:
    """From now on, writing a checkpoint file whose name ends with `name_suffix` fails with `code`, as the disk or
    file server would report it."""
    create_stream = FileSystem.create_stream

    @contextmanager
    def create_failing_stream(self, path, mode: str) -> Iterator:
        if "w" in mode and str(path).endswith(name_suffix):
            yield _FailingFile(code)
            return
        with create_stream(self, path, mode) as stream:
            yield stream

    monkeypatch.setattr(FileSystem, "create_stream", create_failing_stream)


FREE = 1000  # the free bytes the file system reports while it fails
STORAGE_FAILURES = {  # the file that fails, its errno, and what the message says it means and to do
    "no-space-for-a-shard": (".distcp", errno.ENOSPC, "no space left on the device", "free space there"),
    "io-error-on-the-metadata": (".metadata.tmp", errno.EIO, "an I/O error", "check the storage"),
    "no-permission-for-the-config": ("config.toml", errno.EACCES, "permission denied", "make the folder writable"),
}


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
@pytest.mark.parametrize("failure", STORAGE_FAILURES)
def test_a_save_the_storage_cannot_take_leaves_the_earlier_checkpoints_and_says_what_to_do(
    failure, async_mode, world, tmp_path, monkeypatch, caplog
):
    """The failed save's folder is removed and the earlier checkpoint still loads; the StorageError names the
    folder, the rank and its OSError, the bytes needed (the last checkpoint's size) and free, and what to do. An
    async save's failure shows in `failed` without waiting, and the next wait raises it."""
    checkpoints = _manager(tmp_path, async_mode=async_mode)
    checkpoints.components["train"].values["step"] = 2
    checkpoints.save(2)
    checkpoints.wait()
    size = sum(record["size"] for record in json.loads((tmp_path / "step-2" / MANIFEST).read_text())["files"].values())
    suffix, code, what, remedy = STORAGE_FAILURES[failure]
    with monkeypatch.context() as patch:
        _failing_storage(patch, suffix, code)
        patch.setattr(manager, "free_bytes", lambda folder: FREE)
        with pytest.raises(StorageError) as error, caplog.at_level(logging.WARNING, logger="torchpre"):
            if checkpoints.save(4) and async_mode == "async":  # the config is written before save() returns
                _wait_for(lambda: checkpoints.failed)
                checkpoints.wait()
    message = str(error.value)
    fragments = [
        f"the checkpoint of step 4 could not be written to {tmp_path}: {what}",
        f"rank 0: {'PermissionError' if code == errno.EACCES else 'OSError'}: [Errno {code}] {os.strerror(code)}",
        f"It needs about {size:,} bytes; the file system has {FREE:,} bytes free",
        f"{remedy}", f"run the same command again to resume from {tmp_path / 'step-2'}",
    ]  # fmt: skip
    for fragment in fragments:
        assert fragment in message, message
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"the checkpoint of step 4 will not fit in {tmp_path}" in warning for warning in warnings)
    checkpoints.close()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step-2"]
    resumed = _manager(tmp_path)
    assert _loaded_step(resumed, resumed.find(-1)) == 2


def test_a_failed_save_that_is_no_storage_failure_raises_its_own_error(world, tmp_path, monkeypatch):
    """A bug is not disguised as a full disk: with room on the disk and no OSError, DCP's own exception (and its
    traceback) comes out; the unfinished folder is removed all the same."""
    checkpoints = _manager(tmp_path)

    def broken_write_data(self, plan, planner):
        raise ValueError("a bug in a planner")

    monkeypatch.setattr(RecordingWriter, "write_data", broken_write_data)
    with pytest.raises(CheckpointException, match="a bug in a planner"):
        checkpoints.save(2)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_save_leaves_a_tmp_folder_that_lost_torchpres_marker(world, tmp_path, monkeypatch, caplog):
    """A failed save removes its `.tmp-step-2` only while torchpre's marker says it is torchpre's: one swapped for an
    unmarked folder during the write (anyone's) stays, named in a warning, and the save's failure is raised."""
    tmp = tmp_path / ".tmp-step-2"

    def swapped_then_full(self, plan, planner):
        shutil.rmtree(tmp)
        tmp.mkdir()
        (tmp / "theirs.txt").write_text("not torchpre's\n")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(RecordingWriter, "write_data", swapped_then_full)
    with caplog.at_level(logging.WARNING, logger="torchpre"), pytest.raises(StorageError, match="step 2"):
        _manager(tmp_path).save(2)
    assert (tmp / "theirs.txt").read_text() == "not torchpre's\n"
    assert f"left {tmp} in place: it lacks torchpre's marker {MARKER}, so torchpre did not make it" in caplog.text


@pytest.mark.parametrize("on_low_space", ["warn", "skip"])
def test_a_save_that_will_not_fit_is_warned_about_or_skipped(on_low_space, world, tmp_path, monkeypatch, caplog):
    """Estimated from the state's bytes before the first save: "warn" saves anyway (this disk has room: only the
    reported free space is small), "skip" logs an error and saves nothing, and training may go on."""
    monkeypatch.setattr(manager, "free_bytes", lambda folder: 10)
    checkpoints = _manager(tmp_path)
    checkpoints.settings = dataclasses.replace(checkpoints.settings, on_low_space=on_low_space)
    with caplog.at_level(logging.WARNING, logger="torchpre"):
        saved = checkpoints.save(2)
    (record,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    state = 4 * 4 * 4 + 4 * 4 + 4 * 4 * 4  # the toy state's tensors: weight, bias, exp_avg (fp32)
    assert (
        f"the checkpoint of step 2 will not fit in {tmp_path}: it takes about {state:,} bytes (the size of the state), "
        "and the file system has 10 bytes free"
    ) in record.getMessage()
    if on_low_space == "skip":
        assert not saved and record.levelno == logging.ERROR and "skipped this save" in record.getMessage()
        assert list(tmp_path.iterdir()) == []
    else:
        assert saved and record.levelno == logging.WARNING and (tmp_path / "step-2").is_dir()


def test_the_storage_is_blamed_for_an_os_error_on_any_rank_but_not_for_a_broken_connection():
    """DCP hands every rank the failures of all of them; the OSError may also hide behind what torch.save raised."""
    no_space = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    short_write = RuntimeError("unexpected pos 704 vs 598")
    short_write.__cause__ = no_space
    failed = CheckpointException("write", {0: (ValueError("fine"), None), 1: (short_write, None)})
    assert summary(failed) == Failure(True, errno.ENOSPC, "OSError: [Errno 28] No space left on device")
    peer = CheckpointException("write", {1: (ConnectionResetError(errno.ECONNRESET, "reset by peer"), None)})
    assert summary(peer).storage is False
