"""In-memory snapshots (checkpoint.memory_interval): every N steps each rank writes its whole training state (the
same components as the disk checkpoint, in this layout, no resharding) to a file in host memory that outlives the
process (`checkpoint.memory_folder`, /dev/shm by default, a folder per run id), and sends a copy to a peer rank on
another node (checkpoint.memory_replicas = 1, peers.py), so that a restart resumes from the step before a
failure instead of the last disk checkpoint (restore.py).

The state is copied into a host buffer kept across snapshots (the only time training waits); a thread then writes
it, exchanges it with the peers and publishes it, as the async disk save does, on a gloo group of its own. A file is
written under a temporary name and renamed to its final name only once every rank has written its own snapshot and
the replica it keeps, so a published name is always a whole file (its digest is checked on use anyway). The two
newest published steps are kept: a kill while one step is published on some ranks and not others leaves the one
before complete everywhere. A folder that is full (or cannot be written) turns snapshots off on every rank with one
warning, and training goes on; the snapshots are removed when the run ends normally.
"""

import logging
import os
import shutil
import stat
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torchpre.checkpoint.disk import free_bytes
from torchpre.checkpoint.integrity import all_gather
from torchpre.checkpoint.run import ensure_run
from torchpre.checkpoint.snapshots.file_format import Digest, Expected, encode_prefix, entries_of, local, snapshot_name
from torchpre.checkpoint.snapshots.peers import node_key, peer_ranks, same_node_peers
from torchpre.checkpoint.snapshots.restore import Here, Restored, restore
from torchpre.checkpoint.state import Checkpointable, flatten
from torchpre.checkpoint.values import split_values
from torchpre.config.job_config import Checkpoint
from torchpre.confined import make_folder, open_new
from torchpre.distributed.process_groups import comm_timeout
from torchpre.errors import UntrustedInput

logger = logging.getLogger("torchpre")

KEPT = 2  # published steps kept: the newest may be complete on some ranks only when a kill comes


class SnapshotManager:
    """Writes this rank's snapshots of `components` every `settings.memory_interval` steps into its folder under
    `settings.memory_folder`, tied to the run of `checkpoint_folder` (its run id), with `layout` (the parallel
    degrees) recorded so that a restart under another layout never uses them. Every rank builds one, together."""

    def __init__(
        self,
        checkpoint_folder: Path,
        components: Mapping[str, Checkpointable],
        settings: Checkpoint,
        layout: Mapping[str, int],
        signing_key: bytes | None,
    ):
        self.components, self.layout, self.signing_key = dict(components), dict(layout), signing_key
        self.interval = settings.memory_interval
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.group = dist.new_group(backend="gloo", timeout=comm_timeout())
        run = ensure_run(checkpoint_folder, signing_key) if self.rank == 0 else None
        self.run: str = all_gather(run, self.group)[0]
        nodes = all_gather(node_key(), self.group)
        self.node = nodes[self.rank]
        self.peers = peer_ranks(nodes) if settings.memory_replicas and self.world_size > 1 else None
        self.source = self.peers.index(self.rank) if self.peers is not None else None
        if self.peers is not None and self.rank == 0:
            lonely = same_node_peers(nodes, self.peers)
            if lonely:
                logger.warning("the snapshots of ranks %s are replicated on their own node (nodes of unequal size): "
                               "losing that node loses both copies", lonely[:8])  # fmt: skip
        self.folder = Path(settings.memory_folder) / self.run
        self.enabled = self._all_agree(self._make_folder())
        self._buffer: torch.Tensor | None = None  # the staged state, kept across snapshots
        self._received: torch.Tensor | None = None  # the peer's payload, kept across snapshots
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._failures: dict[int, str] = {}  # the ranks whose write failed, for `wait` to turn snapshots off
        self._published: list[int] = []
        self._blocked_s: float | None = None
        self._unreported: int | None = None

    # Saving ------------------------------------------------------------------------------------------------------

    def due(self, step: int, last_step: int) -> bool:
        """Whether step `step` is snapshotted: every interval, except the last (saved on disk, and the run ends)."""
        return self.enabled and step % self.interval == 0 and step != last_step

    def save(self, step: int) -> None:
        """Copies the state after `step` into the host buffer and starts its write in the background (once the
        previous one is done); returns when training may change the state again."""
        start = time.perf_counter()
        self.wait()
        if not self.enabled:
            return
        tensors, values = split_values({key: component.state_dict() for key, component in self.components.items()})
        flat = flatten(tensors)
        expected = self.expected(step, entries_of(flat))
        payload = self._stage(flat, expected)
        prefix = encode_prefix(expected, values)
        self._thread = threading.Thread(
            target=self._write_in_background, args=(step, prefix, payload), name="torchpre-snapshot", daemon=True
        )
        self._thread.start()
        self._blocked_s = time.perf_counter() - start

    def expected(self, step: int, entries: tuple, rank: int | None = None) -> Expected:
        """What `rank`'s (this rank's) snapshot of `step` holds: this run, this layout, the tensors `entries`."""
        rank = self.rank if rank is None else rank
        return Expected(self.run, step, rank, self.world_size, self.layout, entries, self.signing_key)

    def wait(self) -> None:
        """Until the background write, if one runs, is published (or has turned snapshots off); raises its error."""
        if self._thread is None:
            return
        self._thread.join()
        self._thread = None
        if self._failures:  # here, not in the thread: every rank's `due` changes between the same two steps
            self._turn_off(self._failures)
            self._failures = {}
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def metrics(self) -> dict[str, float]:
        """`snapshot/blocked_s` (what the latest snapshot cost the step) and `snapshot/published_step` (the newest
        published since the last call, if any)."""
        record: dict[str, float] = {}
        if self._blocked_s is not None:
            record["snapshot/blocked_s"] = self._blocked_s
        published, self._unreported = self._unreported, None
        if published is not None:
            record["snapshot/published_step"] = published
        return record

    def _stage(self, flat: dict[str, Any], expected: Expected) -> torch.Tensor:
        """The local tensors of `flat` copied into the host buffer at their offsets."""
        size = expected.payload_bytes
        if self._buffer is None or self._buffer.numel() != size:
            device = next((local(value).device for value in flat.values()), torch.device("cpu"))
            self._buffer = torch.empty(size, dtype=torch.uint8, pin_memory=device.type == "cuda")
        with torch.no_grad():
            for entry, value in zip(expected.entries, flat.values()):
                _, _, shape, offset, nbytes = entry
                held = local(value)
                target = self._buffer[offset : offset + nbytes].view(held.dtype).view(shape)
                target.copy_(held.detach(), non_blocking=True)
        if torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()
        return self._buffer

    def _write_in_background(self, step: int, prefix: bytes, payload: torch.Tensor) -> None:
        try:
            self._write_and_publish(step, prefix, payload)
        except BaseException as error:  # raised by the next `save`, `wait` or `close`
            self._error = error

    def _write_and_publish(self, step: int, prefix: bytes, payload: torch.Tensor) -> None:
        """This rank's snapshot file and its peer's replica written under temporary names; renamed once every
        rank's are written, removed (and snapshots off) if any rank's write failed."""
        body = memoryview(payload.numpy())
        digest = Digest(self.signing_key)
        digest.update(prefix)
        digest.update(body)
        parts = (prefix, body, digest.value())
        written: list[tuple[Path, Path]] = []
        failure = self._write(snapshot_name(self.rank, step, "own"), parts, written)
        if self.peers is not None:
            replica = self._exchange(parts)
            failure = failure or self._write(snapshot_name(self.source, step, "replica"), replica, written)
        failed = all_gather(failure, self.group)
        failures = {rank: why for rank, why in enumerate(failed) if why is not None}
        if failures:
            for temporary, _ in written:
                temporary.unlink(missing_ok=True)
            self._failures = failures
            return
        for temporary, final in written:
            try:
                os.replace(temporary, final)
            except OSError as error:  # something in the way (a folder): this step is not this rank's to restore
                logger.warning("the snapshot %s is not published (%s)", final, error.strerror or error)
                temporary.unlink(missing_ok=True)
        self._published.append(step)
        self._unreported = step
        for old in self._published[:-KEPT]:
            self._remove(old)
        self._published = self._published[-KEPT:]

    def _write(self, name: str, parts: tuple, written: list[tuple[Path, Path]]) -> str | None:
        """`parts` written to a temporary file for `name` (added to `written`); why it failed, if it did."""
        temporary, final = self.folder / f".tmp-{name}", self.folder / name
        size = sum(len(part) for part in parts)
        try:
            free = free_bytes(self.folder)
            if free < size:
                return f"{self.folder} has {free:,} bytes free, the snapshot needs {size:,}"
            temporary.unlink(missing_ok=True)  # a killed job's, never a link followed
            with open_new(temporary) as file:
                written.append((temporary, final))
                for part in parts:
                    file.write(part)
        except OSError as error:
            return f"{temporary}: {error.strerror or error}"
        return None

    def _exchange(self, parts: tuple) -> tuple:
        """Sends this rank's snapshot (prefix, payload, digest) to its peer and receives its source's."""
        peer, source = self.peers[self.rank], self.source
        mine = [_as_tensor(part) for part in parts]
        sizes = torch.tensor([part.numel() for part in mine], dtype=torch.int64)
        theirs = torch.empty(3, dtype=torch.int64)
        self._pair(sizes, theirs, peer, source)
        head, body, tail = theirs.tolist()
        if self._received is None or self._received.numel() != body:
            self._received = torch.empty(body, dtype=torch.uint8)
        received = [torch.empty(head, dtype=torch.uint8), self._received, torch.empty(tail, dtype=torch.uint8)]
        for send, receive in zip(mine, received):
            self._pair(send, receive, peer, source)
        return tuple(memoryview(part.numpy()) for part in received)

    def _pair(self, send: torch.Tensor, receive: torch.Tensor, peer: int, source: int) -> None:
        ops = [dist.P2POp(dist.isend, send, peer, self.group), dist.P2POp(dist.irecv, receive, source, self.group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    def _turn_off(self, failures: dict[int, str]) -> None:
        self.enabled = False
        if self.rank == min(failures):
            logger.warning(
                "in-memory snapshots are off from now on, on every rank, and training goes on (disk checkpoints "
                "only): %s%s. Free memory there, or point checkpoint.memory_folder at a folder with room.",
                failures[self.rank], f" (and on {len(failures) - 1} other ranks)" if len(failures) > 1 else "",
            )  # fmt: skip

    def _remove(self, step: int) -> None:
        names = [snapshot_name(self.rank, step, "own")]
        if self.source is not None:
            names.append(snapshot_name(self.source, step, "replica"))
        for name in names:
            (self.folder / name).unlink(missing_ok=True)

    # Restart -------------------------------------------------------------------------------------------------------

    def restore(self, disk_step: int, excluded: list[str]) -> Restored | None:
        """Loads the newest snapshot step complete for every rank and newer than `disk_step` (rank 0's newest disk
        checkpoint), fetching from peers what a rank's folder lacks; None when there is none, on every rank alike.
        Either way the folder keeps only what a second restart could use."""
        entries = entries_of(flatten(split_values({k: c.state_dict() for k, c in self.components.items()})[0]))
        here = Here(
            self.rank, self.node, self.folder, self.group, self.components, lambda step: self.expected(step, entries)
        )
        restored = restore(here, disk_step, excluded) if self.enabled else None
        self._published = [restored.step] if restored is not None else []
        return restored

    # Ending ---------------------------------------------------------------------------------------------------------

    def close(self, finished: bool) -> None:
        """Waits for the background write; when the run has `finished` normally, removes its snapshots."""
        self.wait()
        if finished:
            dist.barrier(group=self.group)  # no rank still reads a replica from this node
            if self._ours():  # never through a link, nor into a FIFO (rmtree would open it and wait)
                shutil.rmtree(self.folder, ignore_errors=True)
                logger.info("removed this run's in-memory snapshots in %s", self.folder)

    def _ours(self) -> bool:
        """Whether this run's folder is a folder (not a link or anything else) of this user."""
        try:
            found = os.lstat(self.folder)
        except OSError:
            return False
        return stat.S_ISDIR(found.st_mode) and found.st_uid == os.getuid()

    def _make_folder(self) -> str | None:
        """This run's folder (created, private, this user's); why it cannot be, if it cannot."""
        try:
            make_folder(self.folder.parent, self.folder.name)
            if not self._ours():
                return f"{self.folder} belongs to another user"
            os.chmod(self.folder, 0o700)
        except (OSError, UntrustedInput) as error:
            return f"{self.folder} cannot be used ({error})"
        return None

    def _all_agree(self, failure: str | None) -> bool:
        failures = {rank: why for rank, why in enumerate(all_gather(failure, self.group)) if why is not None}
        if failures:
            self._turn_off(failures)
        return not failures


def _as_tensor(part: bytes | memoryview) -> torch.Tensor:
    return torch.frombuffer(bytearray(part) if isinstance(part, bytes) else part, dtype=torch.uint8)
