"""Checkpoint integrity without a training job: a save that dies part-way never leaves a folder that loads as
complete, a damaged file is named, and `load_step = -1` falls back past a corrupt checkpoint, on every rank
alike; the manifest's checksums are taken while writing, and async saves stage through one reused stager."""

import builtins
import io
import json
import logging
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import torchpre.checkpoint.manager as manager
from tests.launch import manifest_record, spawn
from torchpre.checkpoint.integrity import MANIFEST, Trust
from torchpre.checkpoint.manager import CheckpointManager
from torchpre.checkpoint.storage import stager_keeps_buffers, staging_options
from torchpre.config.job_config import Checkpoint
from torchpre.errors import TorchpreError


class _Value:
    """A toy component: named plain values (a step, a data position), loaded back through `load_state_dict`."""

    def __init__(self, **values: int) -> None:
        self.values = values
        self.loaded: list[dict[str, int]] = []

    def state_dict(self) -> dict[str, int]:
        return dict(self.values)

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.values = dict(state_dict)
        self.loaded.append(dict(state_dict))


class _Tensors:
    """A toy component whose tensors DCP loads in place."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.tensors

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        pass


def _components(step: int = 0, consumed: int = 0) -> dict[str, object]:
    model = nn.Linear(4, 4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD(model.parameters(), lr=0.1), lambda step: 1.0)
    return {
        "model": _Tensors(model.state_dict()),
        "optimizer": _Tensors({"weight": {"exp_avg": torch.zeros(4, 4)}}),
        "lr_scheduler": scheduler,
        "dataloader": _Value(consumed_samples=consumed),
        "train": _Value(step=step),
    }


def _manager(
    folder: Path, async_mode: str = "disabled", checksums: str = "write", components: dict | None = None
) -> CheckpointManager:
    settings = Checkpoint(enable=True, interval=2, async_mode=async_mode, checksums=checksums)
    return CheckpointManager(folder, components or _components(), settings, "[job]\n", Trust.from_settings(settings))


def _save(folder: Path, *steps: int) -> CheckpointManager:
    checkpoints = _manager(folder)
    for step in steps:
        checkpoints.components["train"].values["step"] = step
        checkpoints.save(step)
    return checkpoints


def _loaded_step(checkpoints: CheckpointManager, step_dir: Path) -> int:
    checkpoints.load(step_dir)
    return checkpoints.components["train"].values["step"]


class Killed(BaseException):
    """Stands for SIGKILL: nothing after the crash point runs (no `except Exception` catches it)."""


def _die(*args, **kwargs):
    raise Killed


def _write_then_die(state_dict, storage_writer):
    """Writes the files, then truncates one as a kill in the middle of the write would, and dies."""
    dcp_save(state_dict, storage_writer=storage_writer)
    shard = next(Path(storage_writer.path).glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])
    raise Killed


def _die_renaming_the_folder(path: Path, target: Path) -> Path:
    if path.name.startswith(".tmp-step-"):
        raise Killed
    return path_rename(path, target)  # DCP's own renames inside the folder


dcp_save, path_rename = manager.dcp.save, Path.rename
CRASH_POINTS = {  # where the save dies: writing the files, gathering their checksums, the manifest, the rename
    "writing": (manager.dcp, "save", _write_then_die),
    "checksumming": (manager, "all_gather", _die),
    "manifest": (manager, "write_manifest", _die),
    "renaming": (Path, "rename", _die_renaming_the_folder),
}


def test_the_data_position_comes_back_exactly(world, tmp_path):
    """The loader resumes at the sample after the last one trained on: one sample early or late shifts every
    later batch."""
    _manager(tmp_path, components=_components(step=3, consumed=24)).save(3)
    resumed = _manager(tmp_path)
    assert resumed.load(resumed.find(-1)) == ["model", "optimizer", "lr_scheduler", "dataloader", "train"]
    assert resumed.components["dataloader"].loaded == [{"consumed_samples": 24}]
    assert resumed.components["train"].values == {"step": 3}


@pytest.mark.parametrize("crash_point", CRASH_POINTS)
def test_a_save_killed_part_way_leaves_no_complete_folder(crash_point, world, tmp_path, monkeypatch):
    checkpoints = _save(tmp_path, 2)
    with monkeypatch.context() as patch:
        patch.setattr(*CRASH_POINTS[crash_point])
        with pytest.raises(Killed):
            checkpoints.save(4)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-step-4", "step-2"]
    restarted = _manager(tmp_path)
    restarted.remove_unfinished()  # what a restarted job's trainer does first: clear what the dead one left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2"]
    assert restarted.find(-1) == tmp_path / "step-2"
    assert _loaded_step(restarted, tmp_path / "step-2") == 2


def test_the_manifest_records_every_file(world, tmp_path):
    _save(tmp_path, 2)
    step_dir = tmp_path / "step-2"
    manifest = json.loads((step_dir / MANIFEST).read_text())
    assert manifest == {"checksums": "write", "files": _records_on_disk(step_dir)}
    assert {".metadata", "config.toml", "__0_0.distcp"} <= set(manifest["files"])


@pytest.mark.parametrize("load_step", [-1, 4])
def test_a_folder_without_a_manifest_is_refused_unless_allowed_and_then_named_in_a_warning(
    load_step, world, tmp_path, caplog
):
    """Nothing checks such a folder's files: refused by default, naming it and the option; loaded with a warning
    naming it when the option is on. The earlier intact checkpoint is never taken instead of it."""
    _save(tmp_path, 2, 4)
    step_dir = tmp_path / "step-4"
    (step_dir / MANIFEST).unlink()  # as another tool, or torchpre before manifests, wrote it
    with pytest.raises(TorchpreError) as error:
        _manager(tmp_path).find(load_step)
    assert f"the checkpoint {step_dir} has no {MANIFEST}" in str(error.value)
    assert "checkpoint.allow_unverified = true" in str(error.value)
    allowing = _manager(tmp_path)
    allowing.trust = Trust(allow_unverified=True)
    with caplog.at_level(logging.WARNING, logger="torchpre"):
        assert _loaded_step(allowing, allowing.find(load_step)) == 4
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"loading {step_dir} unchecked: it has no {MANIFEST} (checkpoint.allow_unverified = true), so a damaged file "
        "in it would go unnoticed"
    ]


def _write_manifest_file(step_dir: Path, manifest: object) -> None:
    (step_dir / MANIFEST).write_text(json.dumps(manifest))


BAD_MANIFESTS = {  # what replaces a valid manifest, and the key the error names
    "files-missing": (lambda files: {"checksums": "write"}, "'files' is missing"),
    "size-a-string": (
        lambda files: {"checksums": "write", "files": files | {".metadata": {"size": "big", "crc32": 1}}},
        "'files..metadata.size' is \"big\", not an integer",
    ),
    "crc-null": (
        lambda files: {"files": files | {"config.toml": {"size": 6, "crc32": None}}},
        "'files.config.toml.crc32' is null, not an integer",
    ),
    "checksums-unknown": (lambda files: {"checksums": "md5", "files": files}, "'checksums' is 'md5', not 'write'"),
    "not-json": (lambda files: "{", "Expecting property name"),
}


@pytest.mark.parametrize("case", BAD_MANIFESTS)
def test_every_field_of_the_manifest_is_checked_and_a_bad_one_is_named(case, world, tmp_path):
    """A manifest with a missing key or a value of the wrong type names the file and the key: an error for a chosen
    step (exit 2), a fallback to the step before for the latest."""
    _save(tmp_path, 2, 4)
    step_dir = tmp_path / "step-4"
    replace, finding = BAD_MANIFESTS[case]
    manifest = replace(json.loads((step_dir / MANIFEST).read_text())["files"])
    if isinstance(manifest, str):
        (step_dir / MANIFEST).write_text(manifest)
    else:
        _write_manifest_file(step_dir, manifest)
    with pytest.raises(TorchpreError, match="checkpoint.load_step = 4") as error:
        _manager(tmp_path).find(4)
    assert f"{step_dir / MANIFEST} is not a valid manifest" in str(error.value)
    assert finding in str(error.value)
    assert _manager(tmp_path).find(-1) == tmp_path / "step-2"


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-7])


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncated": (_truncate, "bytes, not the"),
    "flipped": (_flip_a_byte, "fails its CRC-32 check"),
    "deleted": (Path.unlink, "is missing"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_file_of_the_chosen_step_is_an_error_naming_it(damage, world, tmp_path):
    checkpoints = _save(tmp_path, 2, 4)
    shard = next((tmp_path / "step-4").glob("*.distcp"))
    harm, finding = DAMAGE[damage]
    harm(shard)
    with pytest.raises(TorchpreError, match="checkpoint.load_step = 4") as error:
        _manager(tmp_path).find(4)
    assert f"{shard} " in str(error.value) and finding in str(error.value)
    assert checkpoints.find(2) == tmp_path / "step-2"


def test_a_resume_loads_preflight_s_step_and_looks_again_only_past_a_damaged_latest(world, tmp_path):
    """The trainer resumes from the step preflight found (`resume_step`): a chosen step is checked, never searched
    for, so a damaged later step stays where it is; a damaged chosen step is an error naming it; a latest one found
    damaged by the whole-folder check is the one case that searches back, moving it aside."""
    _save(tmp_path, 2, 4, 6)
    _flip_a_byte(next((tmp_path / "step-6").glob("*.distcp")))
    checkpoints = _manager(tmp_path)
    assert checkpoints.resume_step(tmp_path / "step-4", latest=False) == tmp_path / "step-4"
    assert _loaded_step(checkpoints, tmp_path / "step-4") == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-4", "step-6"]
    with pytest.raises(TorchpreError, match="checkpoint.load_step = 6: the checkpoint .*step-6 is corrupt"):
        _manager(tmp_path).resume_step(tmp_path / "step-6", latest=False)
    assert _manager(tmp_path).resume_step(tmp_path / "step-6", latest=True) == tmp_path / "step-4"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["damaged-step-6", "step-2", "step-4"]


def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous_one(world, tmp_path, caplog):
    _save(tmp_path, 2, 4, 6)
    _flip_a_byte(tmp_path / "step-6" / ".metadata")
    _truncate(next((tmp_path / "step-4").glob("*.distcp")))
    checkpoints = _manager(tmp_path)
    with caplog.at_level(logging.WARNING, logger="torchpre"):
        assert checkpoints.find(-1) == tmp_path / "step-2"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 4
    assert f"checkpoint {tmp_path / 'step-6'} is corrupt" in warnings[0]
    assert f"checkpoint {tmp_path / 'step-4'} is corrupt" in warnings[1]
    # Those skipped are moved aside, named, never deleted: retention does not count them, a new save not replace them.
    assert warnings[2:] == [
        f"moved the damaged checkpoint step-{step} aside to {tmp_path / f'damaged-step-{step}'}; torchpre never "
        "deletes it"
        for step in (4, 6)
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["damaged-step-4", "damaged-step-6", "step-2"]
    assert _loaded_step(checkpoints, tmp_path / "step-2") == 2


def test_every_checkpoint_corrupt_is_an_error(world, tmp_path):
    _save(tmp_path, 2)
    _truncate(tmp_path / "step-2" / "config.toml")
    with pytest.raises(TorchpreError, match="Every checkpoint in .* is corrupt.*config.toml"):
        _manager(tmp_path).find(-1)


def _ranks_agree(mesh) -> None:
    folder = Path(os.environ["INTEGRITY_TEST_FOLDER"])
    _save(folder, 2, 4)
    if dist.get_rank() == 0:  # a file in rank 1's share of the check: rank 0 alone would not see it
        _truncate(folder / "step-4" / "config.toml")
    dist.barrier()
    assert _manager(folder).find(-1) == folder / "step-2"


@pytest.mark.slow
def test_every_rank_picks_the_same_fallback(tmp_path, monkeypatch):
    """Each rank checks a share of the files; the findings are gathered, so all ranks skip the same folder."""
    monkeypatch.setenv("INTEGRITY_TEST_FOLDER", str(tmp_path / "checkpoint"))  # the spawned workers inherit it
    spawn(_ranks_agree, 2, tmp_path / "store")


def _record_reads(monkeypatch, folder: Path) -> list[str]:
    """The files under `folder` opened for reading from now on, through `open` or `Path.open` (which calls
    `io.open`), by any thread."""
    reads: list[str] = []

    def recording(original):
        def open_(file, mode="r", *args, **kwargs):
            if isinstance(file, (str, os.PathLike)) and str(folder) in str(file) and ("r" in mode or "+" in mode):
                reads.append(Path(file).name)
            return original(file, mode, *args, **kwargs)

        return open_

    monkeypatch.setattr(builtins, "open", recording(builtins.open))
    monkeypatch.setattr(io, "open", recording(io.open))
    return reads


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_a_save_reads_none_of_its_files_back_and_its_crcs_are_the_files(async_mode, world, tmp_path, monkeypatch):
    """The manifest's CRCs come from the bytes as they are written: reading the checkpoint back to checksum it
    would double a save's I/O. They must still be exactly zlib's CRC-32 of each file as it lies on disk."""
    checkpoints = _manager(tmp_path, async_mode=async_mode)
    with monkeypatch.context() as patch:
        reads = _record_reads(patch, tmp_path)
        checkpoints.save(2)
        checkpoints.close()
    assert reads == []
    step_dir = tmp_path / "step-2"
    manifest = json.loads((step_dir / MANIFEST).read_text())
    assert manifest == {"checksums": "write", "files": _records_on_disk(step_dir)}


def _records_on_disk(step_dir: Path) -> dict[str, dict[str, int]]:
    """What the manifest should say: zlib's CRC-32 and the size of every other file in the folder."""
    files = [path for path in step_dir.iterdir() if path.name != MANIFEST]
    return {path.name: manifest_record(path) for path in files}


def test_checksums_off_records_sizes_only_and_says_so_on_load(world, tmp_path, caplog):
    """Without checksums a truncated file is still caught by its size; loading says that altered bytes would not be."""
    _manager(tmp_path, checksums="off").save(2)
    manifest = json.loads((tmp_path / "step-2" / MANIFEST).read_text())
    assert manifest["checksums"] == "off"
    assert manifest["files"] and all(set(record) == {"size"} for record in manifest["files"].values())
    with caplog.at_level(logging.INFO, logger="torchpre"):
        assert _manager(tmp_path).find(2) == tmp_path / "step-2"
    assert any('saved without checksums (checkpoint.checksums = "off")' in r.getMessage() for r in caplog.records)
    shard = next((tmp_path / "step-2").glob("*.distcp"))
    _truncate(shard)
    with pytest.raises(TorchpreError, match="bytes, not the"):
        _manager(tmp_path).find(2)


def test_staging_is_pinned_on_cuda_and_torchs_plain_copy_elsewhere():
    """Pinned host buffers make the device-to-host copy a DMA at full bandwidth; staging stays on the training
    thread so the next optimizer step cannot overwrite parameters mid-copy. On the CPU: torch's default."""
    cuda = staging_options(torch.device("cuda", 0))
    assert (cuda.use_pinned_memory, cuda.use_non_blocking_copy, cuda.use_async_staging) == (True, True, False)
    cpu = staging_options(torch.device("cpu"))
    assert not (cpu.use_pinned_memory or cpu.use_shared_memory or cpu.use_async_staging or cpu.use_non_blocking_copy)


@pytest.mark.parametrize("async_mode", ["async", "async_process"])
def test_async_saves_through_one_stager_round_trip_bitwise(async_mode, world, tmp_path, monkeypatch):
    """Two async saves with the weights changed in between: the stager's reused host buffers must hold the second
    save's values, not the first's, and each checkpoint loads back bit for bit. Written by DCP's checkpoint
    process, the manifest still holds every file's CRC (handed back through files that are then removed)."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # where DCP's checkpoint process starts its own store
    stagers = []
    async_save = manager.dcp.async_save

    def spy(*args, async_stager, async_checkpointer_type, **kwargs):
        stagers.append((async_stager, async_checkpointer_type))
        return async_save(*args, async_stager=async_stager, async_checkpointer_type=async_checkpointer_type, **kwargs)

    monkeypatch.setattr(manager.dcp, "async_save", spy)
    checkpoints = _manager(tmp_path, async_mode=async_mode)
    weight = checkpoints.components["model"].tensors["weight"]
    saved = {}
    for step in (2, 4):
        with torch.no_grad():
            weight.copy_(torch.randn(4, 4))
        saved[step] = weight.detach().clone()
        checkpoints.components["train"].values["step"] = step
        checkpoints.save(step)
    checkpoints.close()
    (first, kind), (second, _) = stagers
    assert (first is second) == stager_keeps_buffers()
    assert kind == (AsyncCheckpointerType.PROCESS if async_mode == "async_process" else AsyncCheckpointerType.THREAD)
    for step, expected in saved.items():
        step_dir = tmp_path / f"step-{step}"
        manifest = json.loads((step_dir / MANIFEST).read_text())["files"]
        assert manifest == _records_on_disk(step_dir)
        resumed = _manager(tmp_path)
        assert _loaded_step(resumed, resumed.find(step)) == step
        assert torch.equal(resumed.components["model"].tensors["weight"], expected)
