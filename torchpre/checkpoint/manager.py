"""Checkpoints with torch.distributed.checkpoint: the full training state, saved atomically, loadable
under any parallel layout.

A checkpoint is `{folder}/step-N/`, a DCP folder holding
- "model": parameters by their name in the full model (DTensor shards under TP; each pipeline stage
  writes its own names), so DCP reshards them to whatever layout loads them;
- "optimizer": per parameter, the optimizer's state (AdamW: its moments and step) and the fp32 master, as
  (dp, tp) DTensors;
- "lr_scheduler", "train" (step, global sample position of the data, global batch size, and the saving layout:
  world size, dp, tp, pp, ep and microbatches per step) and "rng" (per rank
  the CPU generator state and, under CUDA, the current device's), plus the resolved `config.toml`.
It is written as `.tmp-step-N` and renamed to `step-N` by rank 0 once every rank has finished, so a
`step-N` folder is always complete; loaders only ever look at `step-N` names, and a restarted job removes
the `.tmp-*` folders a killed one left. Before the rename, `manifest.json` records every file's size and
CRC-32, taken from the bytes as they are written (storage.py), never by reading the files back; loading checks
them, so a file truncated or altered afterwards is named instead of loaded. With checkpoint.checksums = "off" the
manifest holds the sizes only.
"""

import json
import logging
import re
import shutil
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from torchpre.checkpoint.storage import (
    RecordingWriter,
    make_stager,
    model_device,
    published_records,
    stager_keeps_buffers,
)
from torchpre.distributed.utils import comm_timeout
from torchpre.errors import TorchpreError

logger = logging.getLogger("torchpre")

STEP_DIR = re.compile(r"^step-(\d+)$")
PARTS = ("model", "optimizer", "lr_scheduler", "dataloader", "rng")
MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-"


# The layout of the job that saved a checkpoint: how many ranks, the degrees and the microbatches per optimizer step.
# They describe the run, not its state: a resume under another layout compares them, it loads nothing into them.
LAYOUT_KEYS = ("world_size", "dp", "tp", "pp", "ep", "accumulation_steps")
# Entries of the "train" state that older checkpoints lack.
OPTIONAL_TRAIN_KEYS = ("global_batch_size", "dp", "tp", "pp", "ep", "accumulation_steps")


@dataclass
class TrainState:
    """What the training loop must know to continue: its step, the data position and the global batch
    size it trained with (0: a checkpoint from before it was stored), and the saving job's `LAYOUT_KEYS`
    (those the checkpoint holds)."""

    step: int = 0
    consumed_samples: int = 0
    global_batch_size: int = 0
    layout: dict[str, int] = field(default_factory=dict)


def complete_steps(folder: Path) -> list[int]:
    """Steps with a complete checkpoint in `folder`, ascending."""
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for p in folder.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir())


def find_step_dir(folder: Path, load_step: int) -> Path | None:
    """The step folder to load: `load_step`, or the latest complete one (-1); None if there is none."""
    steps = complete_steps(folder)
    if load_step == -1:
        return folder / f"step-{steps[-1]}" if steps else None
    if load_step not in steps:
        available = ", ".join(map(str, steps)) or "none"
        raise TorchpreError(
            f"checkpoint.load_step = {load_step}, but {folder} has no complete step-{load_step} "
            f"(complete steps: {available}). Use -1 for the latest."
        )
    return folder / f"step-{load_step}"


class CheckpointManager:
    """Saves and loads one job's checkpoints.

    `model_parts` are this rank's modules (pipeline stages); `optimizer` has `state_dict()`, `aliases`,
    `masters()` and `parameters_from_masters()` (torchpre's DistributedOptimizer);
    `lr_scheduler` a torch scheduler; `data_position` / `set_data_position` read and restore the
    global sample position of the data loader; `layout` (dp, tp, pp, ep, accumulation_steps) is saved with the
    world size so that a resume under another layout can say what changed.
    """

    def __init__(
        self,
        *,
        folder: Path,
        model_parts: list[nn.Module],
        optimizer,
        lr_scheduler,
        data_position: Callable[[], int],
        set_data_position: Callable[[int], None],
        global_batch_size: int = 0,
        layout: dict[str, int] | None = None,
        config_text: str,
        interval: int,
        keep_latest_k: int,
        async_mode: str,
        model_only: bool,
        exclude_from_loading: list[str],
        checksums: str = "write",
    ):
        self.folder = folder
        self.model_parts = model_parts
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.data_position = data_position
        self.set_data_position = set_data_position
        self.global_batch_size = global_batch_size
        self.layout = dict(layout or {})
        self.config_text = config_text
        self.interval = interval
        self.keep_latest_k = keep_latest_k
        self.model_only = model_only
        self.exclude = set(exclude_from_loading)
        self.checksums = checksums
        self.rank = dist.get_rank()
        # Background writes run their collectives on a group of their own, never interleaved with training's.
        self.async_group = (
            dist.new_group(backend=_background_backend(), timeout=comm_timeout()) if async_mode != "disabled" else None
        )
        # "async_process": DCP's checkpoint process writes (its own gloo group), so the write holds no GIL of ours.
        self.in_process = async_mode == "async_process"
        # Under async_mode the checksums of a finished write are gathered off the training thread too.
        self._background = ThreadPoolExecutor(max_workers=1) if self.async_group is not None else None
        self.device = model_device(model_parts)
        # One stager for every async save, so its host buffers (pinned on CUDA) are allocated once.
        self._stager = self._new_stager() if self.async_group is not None and stager_keeps_buffers() else None
        self._pending: tuple[Future, int, float] | None = None
        self._verified: Path | None = None  # the folder `find` last checked, so `load` does not read it twice

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
        state = self.state_dict(step, model_only=self.model_only)
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
        records = _all_gather(writer.fs.records, group)
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
                _remove(final)
            tmp.rename(final)
            self._apply_retention()
            logger.info("checkpoint %s written in %.2f s", final, seconds)
        dist.barrier()

    def _apply_retention(self) -> None:
        if self.keep_latest_k > 0:
            for step in complete_steps(self.folder)[: -self.keep_latest_k]:
                _remove(self.folder / f"step-{step}")

    # Loading -----------------------------------------------------------------------------------

    def find(self, load_step: int) -> Path | None:
        """`find_intact_step` in this manager's folder; `load` then skips checking it again."""
        self._verified = find_intact_step(self.folder, load_step)
        return self._verified

    def _require_intact(self, step_dir: Path, key: str) -> None:
        if step_dir != self._verified:
            require_intact(step_dir, key)
        self._verified = step_dir

    def load(self, step_dir: Path, model_only: bool = False) -> TrainState:
        """Loads a checkpoint into the live state, resharding to this layout; returns where to continue.

        `model_only` (a run's initial weights), or a checkpoint that holds only weights (saved with
        checkpoint.model_only, or converted from Hugging Face), loads the weights and nothing else. Every
        other entry the job asks for must be in the checkpoint, except the parts in
        checkpoint.exclude_from_loading: a missing one is an error, never a silent fresh start of that state.
        """
        self._require_intact(step_dir, "checkpoint.initial_load_path" if model_only else "checkpoint.load_step")
        saved = checkpoint_metadata(step_dir)
        weights_only = model_only or not any(key.startswith("train.") for key in saved)
        parts = {"model"} if weights_only else set(PARTS) - self.exclude
        keys = {"model", "optimizer", "lr_scheduler", "rng"} & parts
        if not weights_only:
            keys.add("train")
        state = self.state_dict(step=0)
        request = {key: value for key, value in state.items() if key in keys}
        check_shapes(request, saved, step_dir)
        self._drop_tied_aliases(request)
        _drop_absent_rng(request, saved)
        _drop_absent_optional_train_keys(request, saved)
        self._request_weights_in_fp32(request, saved)
        require_present(request, saved, step_dir)
        dcp.load(request, checkpoint_id=str(step_dir))
        self.optimizer.parameters_from_masters()
        if "lr_scheduler" in request:
            self.lr_scheduler.load_state_dict(request["lr_scheduler"])
            # A scheduler's state does not include the optimizer's current lr; restore it too.
            for group, lr in zip(self.lr_scheduler.optimizer.param_groups, self.lr_scheduler.get_last_lr()):
                group["lr"] = lr
        _set_rng_state(request.get("rng", {}), self.rank)
        train = TrainState()
        if "train" in request:
            train.step = int(request["train"]["step"])
            train.global_batch_size = int(request["train"].get("global_batch_size", 0))
            train.layout = {key: int(request["train"][key]) for key in LAYOUT_KEYS if key in request["train"]}
            if "dataloader" in parts:
                train.consumed_samples = int(request["train"]["consumed_samples"])
                self.set_data_position(train.consumed_samples)
        logger.info("loaded %s: %s", step_dir, ", ".join(sorted(keys)))
        return train

    def _drop_tied_aliases(self, request: dict[str, Any]) -> None:
        """The second name of a weight tied within this rank is the first's Parameter: loaded once, under the
        first name (a checkpoint saved before both names were written has only that one)."""
        for alias in self.optimizer.aliases:
            request.get("model", {}).pop(alias, None)
            request.get("optimizer", {}).pop(alias, None)

    def _request_weights_in_fp32(self, request: dict[str, Any], saved: dict[str, Any]) -> None:
        """Loads every parameter through its fp32 master (`optimizer.masters()`), from the saved master when the
        checkpoint has one (a low-precision run), else from the saved parameter; the caller then writes the
        parameters from the masters. So bf16 -> fp32 resumes from the saved fp32 masters and fp32 -> bf16 takes
        the saved fp32 parameters as masters, instead of either going through a bf16-rounded copy."""
        if "model" not in request:
            return
        model, optimizer = request["model"], request.setdefault("optimizer", {})
        for name, master in self.optimizer.masters().items():
            if f"optimizer.{name}.master" in saved:
                optimizer.setdefault(name, {})["master"] = master
                model.pop(name)
            else:
                model[name] = master
                optimizer.get(name, {}).pop("master", None)
        if not optimizer:
            del request["optimizer"]

    def state_dict(self, step: int, model_only: bool = False) -> dict[str, Any]:
        """The state a save at train step `step` writes, as live tensors (DTensors where sharded)."""
        model: dict[str, torch.Tensor] = {}
        for part in self.model_parts:
            model.update(part.state_dict())
        if model_only:
            return {"model": model}
        return {
            "model": model,
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "train": {
                "step": step,
                "consumed_samples": self.data_position(),
                "global_batch_size": self.global_batch_size,
                "world_size": dist.get_world_size(),
                **self.layout,
            },
            "rng": _rng_state(self.rank),
        }


def _background_backend() -> str:
    """gloo (background writes must not share the training group's stream), or the job's own backend when that
    is torch's fake one (a dry run), which has no peers for gloo to connect to."""
    return "fake" if dist.get_backend() == "fake" else "gloo"


def _rng_state(rank: int) -> dict[str, torch.Tensor]:
    """This rank's generator states: the CPU one and, in a process that uses CUDA, its current device's."""
    state = {f"rank{rank}": torch.get_rng_state()}
    if torch.cuda.is_initialized():
        state[f"cuda_rank{rank}"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(saved: dict[str, torch.Tensor], rank: int) -> None:
    """Restores what `_rng_state` saved for this rank; a rank the checkpoint did not have keeps its own state."""
    if f"rank{rank}" in saved:
        torch.set_rng_state(saved[f"rank{rank}"])
    if f"cuda_rank{rank}" in saved:
        torch.cuda.set_rng_state(saved[f"cuda_rank{rank}"])


def saved_global_batch_size(step_dir: Path) -> int:
    """The global batch size `step_dir` was trained with, read without a process group so that a resumed
    job can size its data loader and accumulation before building them; 0 if the checkpoint predates it
    or cannot be read (a damaged one is named, and skipped, by the checked load that follows)."""
    request = {"train": {"global_batch_size": 0}}
    try:
        if "train.global_batch_size" not in checkpoint_metadata(step_dir):
            return 0
        dcp.load(request, checkpoint_id=str(step_dir), no_dist=True)
    except Exception:  # DCP raises several types for damaged files
        return 0
    return int(request["train"]["global_batch_size"])


def checkpoint_problems(step_dir: Path) -> list[str]:
    """Every file of `step_dir` that does not match its manifest. Under a process group each rank checks a
    share and all get all; without one (convert) this process checks every file."""
    if not dist.is_initialized():
        return verify_share(step_dir, 0, 1)
    share = verify_share(step_dir, dist.get_rank(), dist.get_world_size())
    return sorted(problem for part in _all_gather(share) for problem in part)


def find_intact_step(folder: Path, load_step: int) -> Path | None:
    """The intact step folder to load, the same on every rank; None if there is none.

    With -1, a corrupt latest checkpoint is skipped with a warning for the one before it (a job killed
    mid-save is the common case, but disks and copies corrupt files too); a chosen step that is corrupt
    is an error, since loading another one silently would not be what was asked.
    """
    if load_step != -1:
        step_dir = find_step_dir(folder, load_step)
        require_intact(step_dir, f"checkpoint.load_step = {load_step}")
        return step_dir
    corrupt = []
    for step in reversed(complete_steps(folder)):
        step_dir = folder / f"step-{step}"
        problems = checkpoint_problems(step_dir)
        if not problems:
            return step_dir
        corrupt.append(f"{step_dir} ({'; '.join(problems)})")
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.warning("checkpoint %s is corrupt: %s. Trying the one before it.", step_dir, "; ".join(problems))
    if corrupt:
        raise TorchpreError(
            f"Every checkpoint in {folder} is corrupt: {'; '.join(corrupt)}. Restore the files, or move the "
            "folder away (or set checkpoint.folder elsewhere) to start from scratch."
        )
    return None


def require_intact(step_dir: Path, key: str) -> None:
    """Raises, naming `key` (the setting that chose the folder) and the bad files, unless `step_dir` is intact."""
    problems = checkpoint_problems(step_dir)
    if problems:
        raise TorchpreError(
            f"{key}: the checkpoint {step_dir} is corrupt: {'; '.join(problems)}. Load another checkpoint "
            "(checkpoint.load_step = -1 loads the latest intact one) or restore the files."
        )


def verify_share(step_dir: Path, rank: int, world_size: int) -> list[str]:
    """This rank's share (every world_size-th file of the manifest) of checking `step_dir`: one line per file
    that is missing, has another size or fails its checksum (when the save took checksums). A folder without a
    manifest predates them and is trusted, as its atomic rename already vouches for its completeness."""
    path = step_dir / MANIFEST
    if not path.is_file():
        return []
    try:
        files = json.loads(path.read_text(encoding="utf-8"))["files"]
        expected = [(name, int(files[name]["size"]), _optional_int(files[name].get("crc32"))) for name in sorted(files)]
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        return [f"{path} is unreadable ({type(error).__name__}: {error})"] if rank == 0 else []
    if rank == 0 and any(crc is None for _, _, crc in expected):
        logger.info(
            'checkpoint %s was saved without checksums (checkpoint.checksums = "off"): only its file sizes are '
            "checked, so altered bytes would go unnoticed",
            step_dir,
        )
    problems = []
    for name, size, crc in expected[rank::world_size]:
        file = step_dir / name
        try:  # an unreadable file is a finding, not an exception: the other ranks wait for this one's answer
            if not file.is_file():
                problems.append(f"{file} is missing")
            elif file.stat().st_size != size:
                problems.append(f"{file} has {file.stat().st_size} bytes, not the {size} it was saved with")
            elif crc is not None and _crc32(file) != crc:
                problems.append(f"{file} fails its CRC-32 check (its bytes changed after the save)")
        except OSError as error:
            problems.append(f"{file} cannot be read ({error})")
    return problems


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as file:
        while chunk := file.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def _all_gather(value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def _remove(step_dir: Path) -> None:
    """Deletes a checkpoint folder without ever leaving a half-deleted `step-N`: renamed away first (a `.tmp-`
    name, which a restart clears), then deleted."""
    doomed = step_dir.with_name(f"{TMP_PREFIX}removing-{step_dir.name}")
    shutil.rmtree(doomed, ignore_errors=True)
    step_dir.rename(doomed)
    shutil.rmtree(doomed)


def checkpoint_metadata(step_dir: Path) -> dict[str, Any]:
    """The checkpoint's flattened keys ("model.layers.0...") and their metadata; a clear error if the
    folder is not a readable checkpoint."""
    try:
        return dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    except Exception as error:  # DCP raises several types for missing or corrupt metadata
        raise TorchpreError(
            f"Cannot read the checkpoint at {step_dir} ({type(error).__name__}: {error}). "
            "Point checkpoint.folder / checkpoint.initial_load_path at a complete step-N folder."
        ) from None


def flatten(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`state` in one level, nested keys joined with dots as DCP names them ("optimizer.w.exp_avg")."""
    flat = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def check_shapes(request: dict[str, Any], saved: dict[str, Any], step_dir: Path) -> None:
    """Raises, naming every tensor of `request` (a state dict to load) whose saved shape differs, and
    the model weights the checkpoint lacks."""
    mismatched, missing = [], []
    for key, value in flatten(request).items():
        meta = saved.get(key)
        if key.startswith("model.") and meta is None:
            missing.append(key)
        elif isinstance(meta, TensorStorageMetadata) and isinstance(value, torch.Tensor):
            if tuple(meta.size) != tuple(value.shape):
                mismatched.append(f"{key}: checkpoint {tuple(meta.size)} vs model {tuple(value.shape)}")
    if mismatched or missing:
        details = "; ".join(mismatched[:8] + [f"{k}: not in the checkpoint" for k in missing[:8]])
        raise TorchpreError(
            f"The checkpoint at {step_dir} does not fit this model ({len(mismatched)} tensors with other shapes, "
            f"{len(missing)} missing): {details}. Check model.flavor and model.tokenizer_path against the "
            "checkpoint's config.toml."
        )


def _drop_absent_rng(request: dict[str, Any], saved: dict[str, Any]) -> None:
    """A rank the saving job did not have finds no saved RNG state, and keeps its own."""
    rng = {key: value for key, value in request.pop("rng", {}).items() if f"rng.{key}" in saved}
    if rng:
        request["rng"] = rng


def _drop_absent_optional_train_keys(request: dict[str, Any], saved: dict[str, Any]) -> None:
    """A checkpoint written before the train state recorded its global batch size still loads; the job then
    keeps the global batch its config gives."""
    for key in OPTIONAL_TRAIN_KEYS:
        if f"train.{key}" not in saved:
            request.get("train", {}).pop(key, None)


def require_present(request: dict[str, Any], saved: dict[str, Any], step_dir: Path) -> None:
    """Raises on every rank, naming a few of them, their count and the folder, if the checkpoint lacks entries
    that some rank's `request` asks for."""
    missing = [key for key in flatten(request) if key not in saved]
    if dist.is_initialized():
        missing = sorted({key for part in _all_gather(missing) for key in part})
    if missing:
        shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise TorchpreError(
            f"The checkpoint {step_dir} lacks {len(missing)} entries this job loads: {shown}. It was saved by "
            "another model or version of torchpre. Load another checkpoint, or leave that part out on purpose "
            "with checkpoint.exclude_from_loading (e.g. optimizer, lr_scheduler)."
        )
