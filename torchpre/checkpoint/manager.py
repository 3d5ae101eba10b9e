"""Checkpoints with torch.distributed.checkpoint: the whole training state, saved atomically, loadable under any
parallel layout.

The manager saves and loads a mapping of components (`torchpre.checkpoint.state.Checkpointable`): each is one top-level
entry of the DCP folder, and the manager knows nothing of what is inside. A training job's are "model" (parameters by
their name in the full model, DTensor shards under TP, each pipeline stage its own names), "optimizer" (per parameter
its state and, for low-precision parameters, the fp32 master, as DTensors on the state mesh), "lr_scheduler",
"dataloader" (the global sample position), "train" (the step, the global batch size and the saving layout), "rng" (per
rank) and "health" (the step guard's counters). DCP writes and reshards the tensors; the other values (the step,
counters, the data position) go to `state.json` (values.py), so nothing in a torchpre checkpoint needs unpickling beyond
DCP's metadata, which loads through the restricted reader (reader.py). The folder also holds the resolved `config.toml`.

A checkpoint is written as `.tmp-step-N` and published, renamed to `step-N` by rank 0, as soon as every rank has written
its files, so a `step-N` folder is always complete; loaders only ever look at `step-N` names, and a restarted job
removes the `.tmp-*` folders a killed one left, if torchpre's marker says it made them (published.py runs that life
for checkpoints, exports and convert alike; folders.py holds its rules). A `step-N` that is already there when a save
publishes is moved aside, never deleted. Before the rename, `manifest.json` records every file's size and CRC-32, taken
from the bytes as they are written (storage.py), never by reading the files back; loading checks them (integrity.py).
With checkpoint.checksums = "off" the manifest holds the sizes only. An async save is published by a finisher in the
background, on the save's own process group, the moment its write is done.

A save that fails (a full disk, no permission, an I/O error) removes its `.tmp-step-N` and raises a StorageError on
every rank, naming the folder, the bytes it needed and had, and what to do (disk.py); an async save's failure is
raised by the next `save`, `wait` or `close`, and `failed` tells the training loop at once. Before writing, a save
that will not fit in the free space is warned about or skipped (checkpoint.on_low_space).

Checkpoints written before the data position was an entry of its own (main at 0a62600 and earlier) hold it as
"train.consumed_samples"; `LEGACY_LOCATIONS` loads it from there.
"""

import logging
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from torchpre.checkpoint.disk import Failure, free_bytes, low_space_message, summary, unwritten_message
from torchpre.checkpoint.folders import complete_steps, move_aside_damaged
from torchpre.checkpoint.integrity import (
    FileCheck,
    Trust,
    all_gather,
    find_intact_step,
    require_intact,
    write_manifest,
)
from torchpre.checkpoint.published import Finisher, StepFolders, background_group
from torchpre.checkpoint.reader import Loader
from torchpre.checkpoint.run import ensure_run, resume_trust
from torchpre.checkpoint.state import (
    Checkpointable,
    check_shapes,
    checkpoint_metadata,
    load_component,
    load_targets,
    require_present,
    state_bytes,
)
from torchpre.checkpoint.storage import RecordingWriter, make_stager, published_records, stager_keeps_buffers
from torchpre.checkpoint.values import VALUES, encode_values, put_values, read_values, split_values, without_values
from torchpre.config.job_config import Checkpoint
from torchpre.errors import StorageError, UntrustedInput

logger = logging.getLogger("torchpre")

WEIGHTS = "model"
# Where checkpoints of an older format keep an entry that is now elsewhere: (component, key) -> (component, key).
LEGACY_LOCATIONS = {("dataloader", "consumed_samples"): ("train", "consumed_samples")}
T = TypeVar("T")


@dataclass(frozen=True)
class Published:
    """A checkpoint that got its final name: its step, the seconds from the start of its save to the rename (for
    an async save, the background write and its publication), and the bytes of its files."""

    step: int
    seconds: float
    size: int


@dataclass(frozen=True)
class _Unwritten:
    """A save that failed on `ranks`: `message` says why when the storage is to blame; without one it is a bug, and
    each rank raises its own error."""

    ranks: list[int]
    message: str | None


class CheckpointManager:
    """Saves and loads one job's checkpoints of `components` (entry name -> component) in `folder`, as
    `settings` (the job's [checkpoint] section) says: every `interval` steps, the newest `keep_latest_k`, written
    synchronously or in the background (`async_mode`), with or without checksums, everything or the "model" entry
    alone (`model_only`), and without loading the entries `exclude_from_loading` names. `config_text` (the
    resolved config) is saved beside the state; `trust` (the job's, its signing key read once by preflight) says
    what loads accept and signs what saves write."""

    def __init__(
        self,
        folder: Path,
        components: Mapping[str, Checkpointable],
        settings: Checkpoint,
        config_text: str,
        trust: Trust,
    ):
        self.folder, self.components, self.settings, self.trust = folder, dict(components), settings, trust
        self.config_text = config_text
        self.interval = settings.interval
        self.steps = StepFolders(folder, "checkpoint.folder", "checkpoint", settings.keep_latest_k, keeps_marker=True)
        self.checksums = settings.checksums
        self.rank = dist.get_rank()
        async_mode = settings.async_mode
        # Background writes and their publication run their collectives on a group of their own, never interleaved
        # with training's.
        self.async_group = background_group() if async_mode != "disabled" else None
        # "async_process": DCP's checkpoint process writes (its own gloo group), so the write holds no GIL of ours.
        self.in_process = async_mode == "async_process"
        # Under async_mode the finisher that publishes a written save runs in a thread of its own.
        self._finisher = Finisher(background=self.async_group is not None)
        # One stager for every async save, so its host buffers (pinned on CUDA) are allocated once.
        self._stager = self._new_stager() if self.async_group is not None and stager_keeps_buffers() else None
        self._size: int | None = None  # bytes of the last checkpoint saved (every rank's): the next one's estimate
        self._unreported: Published | None = None  # the latest publication the metrics have not shown yet
        self._lock = threading.Lock()  # `_unreported` is set by the finisher's thread
        self._verified: Path | None = None  # the folder `find` last checked, so `load` does not read it twice

    def state_dict(self) -> dict[str, Any]:
        """What a save writes: every component's state, or the weights alone under checkpoint.model_only."""
        saved = [WEIGHTS] if self.settings.model_only else list(self.components)
        return {key: self.components[key].state_dict() for key in saved}

    def remove_unfinished(self) -> None:
        """Rank 0 deletes the temporary folders of saves or deletions that did not finish (a crashed run's), and only
        those (folders.remove_unfinished)."""
        if self.rank == 0:
            self.steps.remove_unfinished()

    # Saving ------------------------------------------------------------------------------------

    def should_save(self, step: int, last_step: int) -> bool:
        return step % self.interval == 0 or step == last_step

    def save(self, step: int) -> bool:
        """Writes step-N; False when it was skipped for lack of space (checkpoint.on_low_space = "skip").

        Synchronous, or with async_mode back once the state is staged: the write, the manifest and the rename to
        step-N then finish in the background, as soon as the write does. A save that fails leaves no folder and
        raises on every rank (an async one at the next `save`, `wait` or `close`; `failed` says so at once): a
        StorageError when the storage is to blame."""
        self.wait()
        state, values = split_values(self.state_dict())
        if self._size is not None:
            needed, estimate = self._size, "the size of the last checkpoint"
        else:
            needed, estimate = state_bytes(state), "the size of the state"
        tmp = self.steps.temporary(step)
        signed = self.trust.signing_key is not None
        writer = RecordingWriter(tmp, crc=self.checksums == "write", publish=self.in_process, sha256=signed)
        values_json = encode_values(values)
        if not self._prepare(step, writer, needed, estimate, values_json):
            return False
        start = time.perf_counter()
        if self.async_group is None:
            try:
                dcp.save(state, storage_writer=writer)
                error = None
            except (Exception, CheckpointException) as failure:  # DCP's CheckpointException is no Exception
                error = failure
            self._finisher.finish(self._publish, step, start, writer, error, needed, values_json, None)
            return True
        stager = self._stager or self._new_stager()
        kind = AsyncCheckpointerType.PROCESS if self.in_process else AsyncCheckpointerType.THREAD
        write = dcp.async_save(
            state,
            storage_writer=writer,
            process_group=self.async_group,
            async_checkpointer_type=kind,
            async_stager=stager,
        )
        if stager is not self._stager:
            stager.close()  # staging is done on return (use_async_staging=False)
        logger.info("checkpoint step-%d staged in %.2f s; writing in the background", step, time.perf_counter() - start)
        self._finisher.finish(self._publish_when_written, write, step, start, writer, needed, values_json)
        return True

    @property
    def failed(self) -> bool:
        """Whether the background save has ended without being published; never waits. Its error is raised by the
        next `save`, `wait` or `close`."""
        return self._finisher.failed

    def wait(self) -> None:
        """Until the background save, if one is running, is published; raises its failure."""
        self._finisher.wait()

    def metrics(self) -> dict[str, float]:
        """For the metrics record: `checkpoint/published_step` and `checkpoint/write_s` (from the start of its save
        to its publication) of the latest checkpoint published since the last call; empty if there is none."""
        with self._lock:
            published, self._unreported = self._unreported, None
        if published is None:
            return {}
        return {"checkpoint/published_step": published.step, "checkpoint/write_s": published.seconds}

    def close(self) -> None:
        try:
            self._finisher.close()
        finally:
            if self._stager is not None:
                self._stager.close()

    def _prepare(self, step: int, writer: RecordingWriter, needed: int, estimate: str, values: bytes) -> bool:
        """Rank 0 checks that the save fits (`needed` bytes, from `estimate`) and creates its folder, marked as
        torchpre's, with the config and the non-tensor state (`values`, state.json's bytes); every rank learns
        whether the save goes ahead, or raises the error that stopped it: a StorageError, or an UntrustedInput for a
        `.tmp-step-N` in the way that torchpre did not make (a link, someone's folder), which it never removes."""
        tmp = Path(writer.path)
        go: bool | str | UntrustedInput = True
        if self.rank == 0:
            try:
                go = self._fits(step, needed, estimate)
                if go:
                    self.steps.create(step, lambda path: writer.fs.create_stream(path, "wb"))
                    for name, content in {"config.toml": self.config_text.encode("utf-8"), VALUES: values}.items():
                        with writer.fs.create_stream(tmp / name, "wb") as file:
                            file.write(content)
            except UntrustedInput as error:
                go = error
            except OSError as error:
                self.steps.discard(tmp)
                failure = summary(error)
                go = unwritten_message(step, self.folder, {0: failure}, needed, free_bytes(self.folder), self._latest())
        go = _broadcast(go, group=None)
        if isinstance(go, UntrustedInput):
            raise go
        if isinstance(go, str):
            raise StorageError(go)
        return go

    def _fits(self, step: int, needed: int, estimate: str) -> bool:
        """Whether the save goes ahead: yes when the folder's file system has the room; otherwise a warning, or with
        checkpoint.on_low_space = "skip" an error-level log and no."""
        free = free_bytes(self.folder)
        if free >= needed:
            return True
        message = low_space_message(step, self.folder, needed, free, estimate)
        if self.settings.on_low_space == "skip":
            latest = self._latest()
            logger.error(
                "%s: skipped this save, and training goes on (checkpoint.on_low_space = 'skip'); the latest "
                "checkpoint is %s. Free space there, or point checkpoint.folder at a file system with room.",
                message, latest if latest is not None else "none yet",
            )  # fmt: skip
            return False
        logger.warning(
            "%s: the save will likely fail and stop the job (checkpoint.on_low_space = 'warn'; 'skip' skips saves "
            "that do not fit and trains on)",
            message,
        )
        return True

    def _publish_when_written(
        self, write: Future, step: int, start: float, writer: RecordingWriter, needed: int, values: bytes
    ) -> Published | BaseException:
        """`_publish` as soon as the background write is done, still in the background, on the save's own group."""
        try:
            write.result()
            error = None
        except (Exception, CheckpointException) as failure:
            error = failure
        outcome = self._publish(step, start, writer, error, needed, values, self.async_group)
        if self.rank == 0 and not isinstance(outcome, Published):
            logger.error("the background save of step %d failed: every rank stops after its step in progress", step)
        return outcome

    def _publish(
        self,
        step: int,
        start: float,
        writer: RecordingWriter,
        error: BaseException | None,
        needed: int,
        values: bytes,
        group: dist.ProcessGroup | None,
    ) -> Published | BaseException:
        """After this rank's part of a save (`error`: how it failed, if it did): every rank's files and failure
        gathered on `group`; rank 0 writes the manifest and renames the folder, or removes it if any rank failed;
        every rank learns the same outcome. Returns the published checkpoint's record, or the error to raise.

        Each rank's writer took its files' sizes and CRCs; a write in DCP's checkpoint process left them in small
        files instead (its memory is not ours), which rank 0 finds complete once its own write is done: DCP's
        coordinator finishes after every rank has written. `values` (state.json's bytes, which rank 0 wrote) must be
        every rank's: each value is saved once, so a component whose values differ between ranks is a bug, named
        here rather than saved as rank 0's."""
        records = {} if self.in_process else writer.fs.records
        parts = all_gather((records, None if error is None else summary(error), values), group)
        failures = {rank: failure for rank, (_, failure, _) in enumerate(parts) if failure is not None}
        outcome: Published | _Unwritten | None = None
        if self.rank == 0:
            files = {name: record for part, _, _ in parts for name, record in part.items()}
            try:
                _require_agreed([part_values for _, _, part_values in parts])
                outcome = self._publish_or_remove(step, start, Path(writer.path), files, failures, needed)
            except Exception as failure:  # told to the others first: they wait for the outcome
                error, outcome = failure, _Unwritten([0], None)
        outcome = _broadcast(outcome, group)
        if isinstance(outcome, Published):
            self._size = outcome.size
            with self._lock:
                self._unreported = outcome
            return outcome
        if outcome.message is not None:
            return StorageError(outcome.message)
        return error or RuntimeError(
            f"the checkpoint of step {step} failed on rank(s) {outcome.ranks}; their errors above say why"
        )

    def _publish_or_remove(
        self, step: int, start: float, tmp: Path, files: dict[str, dict[str, int | str]], failures: dict[int, Failure],
        needed: int,
    ) -> Published | _Unwritten:  # fmt: skip
        """Rank 0's part of `_publish`: the manifest, then the rename that makes the checkpoint visible; or, when a
        rank failed (or the manifest or the rename does), the folder removed and what went wrong."""
        files = published_records(tmp) if self.in_process and not failures else files

        def finalize(folder: Path) -> None:
            key = self.trust.signing_key
            run = ensure_run(self.folder, key) if key is not None else None
            write_manifest(folder, self.checksums, files, key, step, run)

        error = self.steps.publish_or_discard(tmp, step, finalize, failed=bool(failures))
        if error is not None:
            failures = {0: summary(error)}
        if failures:
            free = free_bytes(self.folder)
            message = unwritten_message(step, self.folder, failures, needed, free, self._latest())
            return _Unwritten(sorted(failures), message)
        seconds, size = time.perf_counter() - start, sum(record["size"] for record in files.values())
        logger.info(
            "checkpoint %s published %.2f s after its save started (%s bytes)", self.steps.final(step), seconds,
            f"{size:,}",
        )  # fmt: skip
        self.steps.keep_newest()
        return Published(step, seconds, size)

    def _latest(self) -> Path | None:
        steps = complete_steps(self.folder)
        return self.folder / f"step-{steps[-1]}" if steps else None

    def _new_stager(self):
        return make_stager(self._device(), shared=self.in_process)

    def _device(self) -> torch.device:
        """Where the state lives (for the stager's buffers): the first tensor of the weights' state; the CPU if none."""
        for value in self.components[WEIGHTS].state_dict().values():
            if isinstance(value, torch.Tensor):
                return value.device
        return torch.device("cpu")

    # Loading -----------------------------------------------------------------------------------

    def find(self, load_step: int) -> Path | None:
        """`find_intact_step` in this manager's folder; `load` then skips checking it again. The damaged
        checkpoints it skipped (those after the one it found) are moved aside to `damaged-step-N` by rank 0, so
        that retention never counts them and a later save of their step does not replace them."""
        found = find_intact_step(self.folder, load_step, resume_trust(self.folder, self.trust))
        if load_step == -1 and self.rank == 0:
            move_aside_damaged(self.folder, int(found.name[5:]) if found is not None else -1)
        self._verified = found
        return found

    def resume_step(self, chosen: Path, latest: bool) -> Path:
        """The step a resume loads: `chosen`, the one preflight found from the folder's listing, once its files are
        checked whole (`load` then reads it without checking again). The check reads every file, each rank a share,
        so it waits for the process group, which preflight runs before: a latest step (`latest`) found damaged here
        is the one case that looks through the folder again, for the newest intact step before it (`find`, which
        names every step it skips). A chosen step (checkpoint.load_step) found damaged is an error naming it."""
        if latest:
            return self.find(-1) or chosen  # None only for a folder emptied since preflight: the load names it
        self._require_intact(chosen, f"checkpoint.load_step = {chosen.name.removeprefix('step-')}", weights_only=False)
        return chosen

    def _require_intact(self, step_dir: Path, key: str, weights_only: bool) -> FileCheck:
        """The folder checked whole (on every rank, each a share), as a FileCheck that then reads without checking
        again. A resume's checkpoint must be this run's; a run's initial weights may be any run's."""
        trust = self.trust if weights_only else resume_trust(self.folder, self.trust)
        if step_dir != self._verified:
            require_intact(step_dir, key, trust)
        self._verified = step_dir
        return FileCheck(step_dir, trust, key).whole_folder_checked()

    def load(self, step_dir: Path, weights_only: bool = False) -> list[str]:
        """Loads a checkpoint into the live components, resharding to this layout; returns the entries loaded.

        `weights_only` (a run's initial weights), or a checkpoint that holds only weights (saved with
        checkpoint.model_only, or converted from Hugging Face), loads the "model" entry and nothing else. Every
        other entry must be in the checkpoint, except those checkpoint.exclude_from_loading names and what a
        component leaves out of its `load_targets`: a missing one is an error, never a silent fresh start of that
        state. The folder is checked against its manifest before any of its files is read.
        """
        key = "checkpoint.initial_load_path" if weights_only else "checkpoint.load_step"
        check = self._require_intact(step_dir, key, weights_only)
        metadata = checkpoint_metadata(check, self.settings.allow_pickle)
        values = read_values(check) or {}
        saved = set(metadata)
        weights_only = weights_only or all(key.startswith(f"{WEIGHTS}.") for key in saved)
        excluded = self.settings.exclude_from_loading
        keys = [WEIGHTS] if weights_only else [key for key in self.components if key not in excluded]
        request = {key: load_targets(self.components[key], saved) for key in keys}
        request = {key: targets for key, targets in request.items() if targets or key == WEIGHTS}
        moved = _from_legacy_locations(request, saved)
        check_shapes(request, metadata, step_dir)
        require_present(request, metadata, step_dir)
        loaded = without_values(request, values)
        Loader(check, self.settings.allow_pickle).load(loaded)
        put_values(loaded, request, values, step_dir)
        _to_current_locations(loaded, moved)
        for key, state in loaded.items():
            load_component(self.components[key], key, state, step_dir)
        logger.info("loaded %s: %s", step_dir, ", ".join(sorted(loaded)))
        return list(loaded)


def _from_legacy_locations(request: dict[str, Any], saved: set[str]) -> list[tuple[tuple, tuple]]:
    """Requests each entry a checkpoint of an older format keeps elsewhere (`LEGACY_LOCATIONS`) from there; returns
    the moves, for `_to_current_locations` to undo after loading."""
    moved = []
    for (component, key), (old_component, old_key) in LEGACY_LOCATIONS.items():
        wanted = component in request and key in request[component]
        if wanted and f"{component}.{key}" not in saved and f"{old_component}.{old_key}" in saved:
            request.setdefault(old_component, {})[old_key] = request[component].pop(key)
            moved.append(((component, key), (old_component, old_key)))
    return moved


def _to_current_locations(request: dict[str, Any], moved: list[tuple[tuple, tuple]]) -> None:
    for (component, key), (old_component, old_key) in moved:
        request[component][key] = request[old_component].pop(old_key)


def _require_agreed(values: list[bytes]) -> None:
    """Raises unless every rank's `state.json` bytes (by rank) are rank 0's."""
    differing = [rank for rank, part in enumerate(values) if part != values[0]]
    if differing:
        raise RuntimeError(
            f"the checkpoint's non-tensor values (state.json) differ on ranks {differing[:8]} from rank 0's; each is "
            "saved once, so a component must keep per-rank values in tensors under per-rank keys (as RNGState does)"
        )


def _broadcast(value: T, group: dist.ProcessGroup | None) -> T:
    """Rank 0's `value`, on every rank of `group`."""
    box = [value]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]

