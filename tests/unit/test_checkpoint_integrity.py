"""Checkpoint integrity without a training job: a save that dies part-way never leaves a folder that loads as
complete, a damaged file is named, and `load_step = -1` falls back past a corrupt checkpoint, on every rank
alike."""

import logging
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import torchpre.checkpoint.manager as manager
from tests.launch import spawn
from torchpre.checkpoint.manager import MANIFEST, CheckpointManager
from torchpre.errors import TorchpreError


class _Optimizer:
    """What the manager needs of torchpre's optimizer: a state dict and the master weights (none here: the
    parameters load as they are)."""

    aliases: dict[str, str] = {}

    def __init__(self) -> None:
        self.state = {"weight": {"exp_avg": torch.zeros(4, 4)}}

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        return self.state

    def masters(self) -> dict[str, torch.Tensor]:
        return {}

    def parameters_from_masters(self) -> None:
        pass


def _manager(
    folder: Path,
    data_position: Callable[[], int] = lambda: 0,
    set_data_position: Callable[[int], None] = lambda position: None,
) -> CheckpointManager:
    model = nn.Linear(4, 4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD(model.parameters(), lr=0.1), lambda step: 1.0)
    return CheckpointManager(
        folder=folder,
        model_parts=[model],
        optimizer=_Optimizer(),
        lr_scheduler=scheduler,
        data_position=data_position,
        set_data_position=set_data_position,
        config_text="[job]\n",
        interval=2,
        keep_latest_k=0,
        async_mode="disabled",
        model_only=False,
        exclude_from_loading=[],
    )


def _save(folder: Path, *steps: int) -> CheckpointManager:
    checkpoints = _manager(folder)
    for step in steps:
        checkpoints.save(step)
    return checkpoints


class Killed(BaseException):
    """Stands for SIGKILL: nothing after the crash point runs (no `except Exception` catches it)."""


def _die(*args, **kwargs):
    raise Killed


def _write_then_die(state_dict, checkpoint_id):
    """Writes the files, then truncates one as a kill in the middle of the write would, and dies."""
    dcp_save(state_dict, checkpoint_id=checkpoint_id)
    shard = next(Path(checkpoint_id).glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])
    raise Killed


def _die_renaming_the_folder(path: Path, target: Path) -> Path:
    if path.name.startswith(".tmp-step-"):
        raise Killed
    return path_rename(path, target)  # DCP's own renames inside the folder


dcp_save, path_rename = manager.dcp.save, Path.rename
CRASH_POINTS = {  # where the save dies: writing the files, checksumming them, renaming the folder
    "writing": (manager.dcp, "save", _write_then_die),
    "checksumming": (manager, "_file_record", _die),
    "renaming": (Path, "rename", _die_renaming_the_folder),
}


def test_the_data_position_comes_back_exactly(world, tmp_path):
    """The loader resumes at the sample after the last one trained on: one sample early or late shifts every
    later batch."""
    _manager(tmp_path, data_position=lambda: 24).save(3)
    restored: list[int] = []
    resumed = _manager(tmp_path, set_data_position=restored.append)
    train = resumed.load(resumed.find(-1))
    assert (train.step, train.consumed_samples, restored) == (3, 24, [24])


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
    assert restarted.load(tmp_path / "step-2").step == 2


def test_the_manifest_records_every_file_and_a_folder_without_one_is_trusted(world, tmp_path):
    checkpoints = _save(tmp_path, 2)
    step_dir = tmp_path / "step-2"
    manifest = (step_dir / MANIFEST).read_text()
    assert all(f'"{p.name}"' in manifest for p in step_dir.iterdir() if p.name != MANIFEST)
    (step_dir / MANIFEST).unlink()  # as written before manifests existed
    assert checkpoints.find(-1) == step_dir


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


def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous_one(world, tmp_path, caplog):
    _save(tmp_path, 2, 4, 6)
    _flip_a_byte(tmp_path / "step-6" / ".metadata")
    _truncate(next((tmp_path / "step-4").glob("*.distcp")))
    checkpoints = _manager(tmp_path)
    with caplog.at_level(logging.WARNING, logger="torchpre"):
        assert checkpoints.find(-1) == tmp_path / "step-2"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert f"checkpoint {tmp_path / 'step-6'} is corrupt" in warnings[0]
    assert f"checkpoint {tmp_path / 'step-4'} is corrupt" in warnings[1]
    assert checkpoints.load(tmp_path / "step-2").step == 2


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
