"""Checkpoints with torch.distributed.checkpoint: the whole training state, saved atomically, loadable under any
parallel layout.

The manager saves and loads a mapping of components (`torchpre.checkpoint.state.Checkpointable`): each is one
top-level entry of the DCP folder, and the manager knows nothing of what is inside. A training job's are "model"
(parameters by their name in the full model, DTensor shards under TP, each pipeline stage its own names),
"optimizer" (per parameter its state and, for low-precision parameters, the fp32 master, as DTensors on the state
mesh), "lr_scheduler", "dataloader" (the global sample position), "train" (the step, the global batch size and the
saving layout), "rng" (per rank) and "health" (the step guard's counters); the folder also holds the resolved
`config.toml`. DCP reshards every tensor to whatever layout loads it.

A checkpoint is written as `.tmp-step-N` and renamed to `step-N` by rank 0 once every rank has finished, so a
`step-N` folder is always complete; loaders only ever look at `step-N` names, and a restarted job removes the
`.tmp-*` folders a killed one left. Before the rename, `manifest.json` records every file's size and CRC-32, taken
from the bytes as they are written (storage.py), never by reading the files back; loading checks them
(integrity.py). With checkpoint.checksums = "off" the manifest holds the sizes only.

Checkpoints written before the data position was an entry of its own (main at 0a62600 and earlier) hold it as
"train.consumed_samples"; `LEGACY_LOCATIONS` loads it from there.
"""

import json
import logging
import shutil
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from torchpre.checkpoint.folders import TMP_PREFIX, complete_steps, remove_step
from torchpre.checkpoint.integrity import MANIFEST, all_gather, find_intact_step, require_intact
from torchpre.checkpoint.state import (
    Checkpointable,
    check_shapes,
    checkpoint_metadata,
    load_targets,
    require_present,
)
from torchpre.checkpoint.storage import RecordingWriter, make_stager, published_records, stager_keeps_buffers
from torchpre.config.job_config import Checkpoint
from torchpre.distributed.utils import comm_timeout

logger = logging.getLogger("torchpre")

WEIGHTS = "model"
# Where checkpoints of an older format keep an entry that is now elsewhere: (component, key) -> (component, key).
LEGACY_LOCATIONS = {("dataloader", "consumed_samples"): ("train", "consumed_samples")}


class CheckpointManager:
    """Saves and loads one job's checkpoints of `components` (entry name -> component) in `folder`, as
    `settings` (the job's [checkpoint] section) says: every `interval` steps, the newest `keep_latest_k`, written
    synchronously or in the background (`async_mode`), with or without checksums, everything or the "model" entry
    alone (`model_only`), and without loading the entries `exclude_from_loading` names. `config_text` (the
    resolved config) is saved beside the state."""

    def __init__(
        self,
        folder: Path,
        components: Mapping[str, Checkpointable],
        settings: Checkpoint,
        config_text: str,
    ):
        self.folder, self.components, self.settings = folder, dict(components), settings
        self.config_text = config_text
        self.interval, self.keep_latest_k = settings.interval, settings.keep_latest_k
        self.checksums = settings.checksums
        self.rank = dist.get_rank()
        async_mode = settings.async_mode
        # Background writes run their collectives on a group of their own, never interleaved with training's.
        self.async_group = (
            dist.new_group(backend=_background_backend(), timeout=comm_timeout()) if async_mode != "disabled" else None
        )
        # "async_process": DCP's checkpoint process writes (its own gloo group), so the write holds no GIL of ours.
        self.in_process = async_mode == "async_process"
        # Under async_mode the checksums of a finished write are gathered off the training thread too.
        self._background = ThreadPoolExecutor(max_workers=1) if self.async_group is not None else None
        # One stager for every async save, so its host buffers (pinned on CUDA) are allocated once.
        self._stager = self._new_stager() if self.async_group is not None and stager_keeps_buffers() else None
        self._pending: tuple[Future, int, float] | None = None
        self._verified: Path | None = None  # the folder `find` last checked, so `load` does not read it twice

    def state_dict(self) -> dict[str, Any]:
        """What a save writes: every component's state, or the weights alone under checkpoint.model_only."""
        saved = [WEIGHTS] if self.settings.model_only else list(self.components)
        return {key: self.components[key].state_dict() for key in saved}

    def remove_unfinished(self) -> None:
        """Rank 0 deletes the temporary folders of saves or deletions that did not finish (a crashed run's)."""
        if self.rank == 0:
            for stale in self.folder.glob(f"{TMP_PREFIX}*"):
                shutil.rmtree(stale, ignore_errors=True)
                logger.info("removed %s, left by a save or deletion that did not finish", stale)

    # Saving ------------------------------------------------------------------------------------

    def should_save(self, step: int, last_step: int) -> bool:
        return step % self.interval == 0 or step == last_step

    def save(self, step: int) -> None:
        """Writes step-N; with async_mode, returns once the state is staged and finishes the write
        in the background (the rename to step-N happens when the next save or `close()` waits for it)."""
        self.wait()
        tmp = self.folder / f".tmp-step-{step}"
        writer = RecordingWriter(tmp, crc=self.checksums == "write", publish=self.in_process)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            with writer.fs.create_stream(tmp / "config.toml", "wb") as config:
                config.write(self.config_text.encode("utf-8"))
        dist.barrier()
        state = self.state_dict()
        start = time.perf_counter()
        if self.async_group is None:
            dcp.save(state, storage_writer=writer)
            self._finish(step, time.perf_counter() - start, self._manifest_files(writer))
        else:
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
            staging = time.perf_counter() - start
            logger.info("checkpoint step-%d staged in %.2f s; writing in the background", step, staging)
            self._pending = (self._background.submit(self._manifest_files_when_written, write, writer), step, start)

    def wait(self) -> None:
        """Completes a background save, if one is running."""
        if self._pending is None:
            return
        checksums, step, start = self._pending
        self._pending = None
        self._finish(step, time.perf_counter() - start, checksums.result())

    def close(self) -> None:
        self.wait()
        if self._background is not None:
            self._background.shutdown()
        if self._stager is not None:
            self._stager.close()

    def _new_stager(self):
        return make_stager(self.device, shared=self.in_process)

    def _manifest_files(
        self, writer: RecordingWriter, group: dist.ProcessGroup | None = None
    ) -> dict[str, dict[str, int]]:
        """Once every rank has written its files, each file's size and CRC-32, as each rank's writer took them
        (rank 0 alone needs them). A write in DCP's checkpoint process left them in small files: its coordinator
        finishes after every rank has written, so rank 0 finds them all once its own write is done."""
        if self.in_process:
            return published_records(writer.path) if self.rank == 0 else {}
        records = all_gather(writer.fs.records, group)
        return {name: record for part in records for name, record in part.items()}

    def _manifest_files_when_written(self, write: Future, writer: RecordingWriter) -> dict[str, dict[str, int]]:
        """`_manifest_files` after a background write, still in the background and on the save's own group."""
        write.result()
        return self._manifest_files(writer, self.async_group)

    def _finish(self, step: int, seconds: float, checksums: dict[str, dict[str, int]]) -> None:
        """The manifest, then the rename that makes the checkpoint visible."""
        tmp = self.folder / f"{TMP_PREFIX}step-{step}"
        if self.rank == 0:
            manifest = {"checksums": self.checksums, "files": checksums}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True), encoding="utf-8")
            final = self.folder / f"step-{step}"
            if final.exists():
                remove_step(final)
            tmp.rename(final)
            self._apply_retention()
            logger.info("checkpoint %s written in %.2f s", final, seconds)
        dist.barrier()

    def _apply_retention(self) -> None:
        if self.keep_latest_k > 0:
            for step in complete_steps(self.folder)[: -self.keep_latest_k]:
                remove_step(self.folder / f"step-{step}")

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
        """`find_intact_step` in this manager's folder; `load` then skips checking it again."""
        self._verified = find_intact_step(self.folder, load_step, self.settings.allow_unverified)
        return self._verified

    def _require_intact(self, step_dir: Path, key: str) -> None:
        if step_dir != self._verified:
            require_intact(step_dir, key, self.settings.allow_unverified)
        self._verified = step_dir

    def load(self, step_dir: Path, weights_only: bool = False) -> list[str]:
        """Loads a checkpoint into the live components, resharding to this layout; returns the entries loaded.

        `weights_only` (a run's initial weights), or a checkpoint that holds only weights (saved with
        checkpoint.model_only, or converted from Hugging Face), loads the "model" entry and nothing else. Every
        other entry must be in the checkpoint, except those checkpoint.exclude_from_loading names and what a
        component leaves out of its `load_targets`: a missing one is an error, never a silent fresh start of that
        state.
        """
        self._require_intact(step_dir, "checkpoint.initial_load_path" if weights_only else "checkpoint.load_step")
        metadata = checkpoint_metadata(step_dir)
        saved = set(metadata)
        weights_only = weights_only or all(key.startswith(f"{WEIGHTS}.") for key in saved)
        excluded = self.settings.exclude_from_loading
        keys = [WEIGHTS] if weights_only else [key for key in self.components if key not in excluded]
        request = {key: load_targets(self.components[key], saved) for key in keys}
        request = {key: targets for key, targets in request.items() if targets or key == WEIGHTS}
        moved = _from_legacy_locations(request, saved)
        check_shapes(request, metadata, step_dir)
        require_present(request, metadata, step_dir)
        dcp.load(request, checkpoint_id=str(step_dir))
        _to_current_locations(request, moved)
        for key, state in request.items():
            self.components[key].load_state_dict(state)
        logger.info("loaded %s: %s", step_dir, ", ".join(sorted(request)))
        return list(request)


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


def _background_backend() -> str:
    """gloo (background writes must not share the training group's stream), or the job's own backend when that
    is torch's fake one (a dry run), which has no peers for gloo to connect to."""
    return "fake" if dist.get_backend() == "fake" else "gloo"
