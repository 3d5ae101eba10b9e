"""How a checkpoint's bytes leave the process: a DCP file writer that takes each file's size, CRC-32 and (for a signed
save) SHA-256 from the bytes as it writes them (so the manifest costs no second read of the checkpoint), writes DCP's
metadata as plain data too (`metadata.json`, which loads read instead of the pickled `.metadata`), and reports a
failed write as the OSError it was, and the stager that copies the state to host memory for an async save (pinned,
reused buffers on CUDA)."""

import functools
import hashlib
import json
import os
import threading
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions
from torch.distributed.checkpoint.storage import WriteResult

from torchpre.checkpoint.metadata_json import METADATA_JSON, encode

RECORDS = "records.json"  # a rank's file records, for a writer in DCP's checkpoint process: `__{rank}_records.json`


class _RecordingStream:
    """A file opened for writing that keeps the count and, optionally, the CRC-32 and the SHA-256 of the bytes written
    through it. DCP writes each file front to back, so these are the file's; a seek would break that, so it has none. An
    OSError of the file goes to `failed` before it propagates: torch.save, which writes through this stream, turns it
    into a RuntimeError about a short write ("unexpected pos")."""

    def __init__(self, file, crc: bool, sha256: bool, failed: Callable[[OSError], None]) -> None:
        self._file = file
        self._crc = 0 if crc else None
        self._sha256 = hashlib.sha256() if sha256 else None
        self._failed = failed
        self.size = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        with self._reporting():
            written = self._file.write(data)
        if self._crc is not None:
            self._crc = zlib.crc32(data, self._crc)
        if self._sha256 is not None:
            self._sha256.update(data)
        self.size += written
        return written

    def tell(self) -> int:
        return self._file.tell()

    def flush(self) -> None:
        with self._reporting():
            self._file.flush()

    def fileno(self) -> int:
        return self._file.fileno()

    def close(self) -> None:
        with self._reporting():
            self._file.close()

    @contextmanager
    def _reporting(self) -> Iterator[None]:
        try:
            yield
        except OSError as error:
            self._failed(error)
            raise

    def record(self) -> dict[str, int | str]:
        record: dict[str, int | str] = {"size": self.size}
        if self._crc is not None:
            record["crc32"] = self._crc
        if self._sha256 is not None:
            record["sha256"] = self._sha256.hexdigest()
        return record


class RecordingFileSystem(FileSystem):
    """DCP's local file system, remembering the size (with `crc` the CRC-32, with `sha256` the SHA-256) of every file
    written through it, by file name, after DCP's renames (its `.metadata.tmp` becomes `.metadata`), and the first
    OSError a write met (`failure`)."""

    def __init__(self, crc: bool, sha256: bool = False) -> None:
        super().__init__()
        self.crc, self.sha256 = crc, sha256
        self.records: dict[str, dict[str, int | str]] = {}
        self.failure: OSError | None = None
        self._lock = threading.Lock()  # DCP may write with several threads

    @contextmanager
    def create_stream(self, path, mode: str) -> Iterator:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            recording = _RecordingStream(stream, self.crc, self.sha256, self._failed)
            yield recording
        with self._lock:
            self.records[Path(path).name] = recording.record()

    def _failed(self, error: OSError) -> None:
        with self._lock:
            self.failure = self.failure or error

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        with self._lock:
            if (record := self.records.pop(Path(path).name, None)) is not None:
                self.records[Path(new_path).name] = record

    def __getstate__(self) -> dict:
        """Without the lock, which does not pickle (DCP sends the writer to its checkpoint process)."""
        return {key: value for key, value in self.__dict__.items() if key != "_lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


class RecordingWriter(FileSystemWriter):
    """`FileSystemWriter` whose `fs.records` lists the files this process wrote, with their sizes, CRCs and (with
    `sha256`, for a signed save) SHA-256 digests. The coordinator writes `metadata.json` after DCP's `.metadata`,
    through the same file system, so the manifest records it like every other file.

    With `publish`, for a writer that runs in DCP's checkpoint process (whose memory the trainer never sees), it
    also writes them to `__{rank}_records.json` once its files are written, and again with `.metadata` once it
    is (the coordinator); `published_records` reads them back and removes them."""

    def __init__(self, path: Path, crc: bool, publish: bool = False, sha256: bool = False) -> None:
        super().__init__(path)
        self.fs = RecordingFileSystem(crc, sha256)
        self.publish = publish
        self._prefix = ""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self._prefix = plan.storage_data.prefix
        with self._raising_the_os_error():
            written = super().write_data(plan, planner)
            self._publish()
        return written

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        with self._raising_the_os_error():
            super().finish(metadata, results)  # completes `metadata` (storage records, version) and pickles it
            with self.fs.create_stream(Path(self.path) / METADATA_JSON, "wb") as file:
                file.write(encode(metadata))
                if self.sync_files:  # as durable as DCP makes `.metadata`
                    file.flush()
                    os.fsync(file.fileno())
            self._publish()

    @contextmanager
    def _raising_the_os_error(self) -> Iterator[None]:
        """A failed write raises the OSError behind it (no space, no permission, an I/O error), which DCP passes on
        to every rank, rather than what torch.save made of it."""
        try:
            yield
        except Exception:
            if self.fs.failure is None:
                raise
            raise self.fs.failure from None

    def _publish(self) -> None:
        if self.publish:
            (Path(self.path) / f"{self._prefix}{RECORDS}").write_text(json.dumps(self.fs.records), encoding="utf-8")


def published_records(folder: Path) -> dict[str, dict[str, int | str]]:
    """Every rank's records that `RecordingWriter(publish=True)` left in `folder`, merged; the files are removed."""
    records = {}
    for path in sorted(folder.glob(f"*{RECORDS}")):
        records.update(json.loads(path.read_text(encoding="utf-8")))
        path.unlink()
    return records


def staging_options(device: torch.device, shared: bool = False) -> StagingOptions:
    """How an async save copies the state to the host. On CUDA: into pinned buffers (a fast DMA copy instead of a
    pageable one), kept from one save to the next, with non-blocking copies waited for once at the end. Staging
    stays on the training thread (use_async_staging=False): staged in the background, the next optimizer step
    would overwrite parameters mid-copy unless the loop waited for it. Elsewhere torch's own default: plain copies.
    `shared` (a write in DCP's checkpoint process): in shared memory, so the state reaches that process without
    being pickled."""
    on_cuda = device.type == "cuda"
    return StagingOptions(
        use_pinned_memory=on_cuda,
        use_shared_memory=shared,
        use_async_staging=False,
        use_non_blocking_copy=on_cuda,
    )


@functools.cache
def stager_keeps_buffers() -> bool:
    """Whether torch's `DefaultStager` copies into the same host buffers save after save (torch 2.14). Torch 2.11's
    clears its cache, and its copy dispatch with it, after every stage, so a stager kept across saves fails there
    and each save needs a new one (pinned still, but allocated anew)."""
    stager = DefaultStager(staging_options(torch.device("cpu")))
    source = {"x": torch.zeros(2)}
    try:
        first, second = stager.stage(source), stager.stage(source)
        return first["x"].data_ptr() == second["x"].data_ptr()
    except Exception:  # KeyError under torch 2.11: the stager's copy dispatch is gone
        return False
    finally:
        stager.close()


def make_stager(device: torch.device, shared: bool = False) -> AsyncStager:
    return DefaultStager(staging_options(device, shared))
