"""In-memory snapshots on two gloo ranks, each with a folder of its own as if on two nodes: what is published, what
a restart resumes from (the same step on every rank, a peer's replica for an emptied folder, never a torn file), and
a full folder turning snapshots off on every rank without a published file of that step."""

import functools
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from tests.launch import spawn
from torchpre.checkpoint.integrity import all_gather
from torchpre.checkpoint.snapshots import manager as snapshots
from torchpre.checkpoint.snapshots.file_format import snapshot_name
from torchpre.checkpoint.snapshots.manager import SnapshotManager
from torchpre.checkpoint.state import RNGState
from torchpre.config.job_config import Checkpoint

LAYOUT = {"world_size": 2, "dp": 2, "tp": 1, "pp": 1, "ep": 1, "cp": 1}


class Progress:
    """The "train" entry: the step."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]


class Weights:
    """Per-rank tensors of several dtypes whose values say the step and rank they were set at."""

    def __init__(self) -> None:
        self.w = torch.zeros(4, 6)
        self.h = torch.zeros(5, dtype=torch.bfloat16)

    def set(self, step: int, rank: int) -> None:
        self.w.copy_(_value(step, rank, self.w.shape, torch.float32))
        self.h.copy_(_value(step, rank, self.h.shape, torch.bfloat16))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"w": self.w, "h": self.h}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        pass  # loaded in place


def _value(step: int, rank: int, shape, dtype) -> torch.Tensor:
    return (torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape) / 7 + 100 * step + rank).to(dtype)


def _build(root: Path, layout: dict[str, int] = LAYOUT) -> tuple[SnapshotManager, Progress, Weights]:
    rank = dist.get_rank()
    settings = Checkpoint(enable=True, memory_interval=1, memory_folder=str(root / f"node{rank}"))
    progress, weights = Progress(), Weights()
    components = {"model": weights, "train": progress, "rng": RNGState()}
    return SnapshotManager(root / "checkpoint", components, settings, layout, None), progress, weights


def _train(manager: SnapshotManager, progress: Progress, weights: Weights, steps: range) -> None:
    for step in steps:
        progress.step = step
        weights.set(step, dist.get_rank())
        manager.save(step)
    manager.wait()


def _restart(root: Path, disk_step: int = 0, layout: dict[str, int] = LAYOUT):
    """A new job's manager (the state zeroed) restoring; every rank's outcome."""
    manager, progress, weights = _build(root, layout)
    restored = manager.restore(disk_step, [])
    return manager, progress, weights, all_gather(restored.step if restored else None)


def _folder(root: Path, rank: int, manager: SnapshotManager) -> Path:
    return root / f"node{rank}" / manager.run


def _check_restarts(root: Path, mesh: DeviceMesh) -> None:
    rank = dist.get_rank()
    manager, progress, weights = _build(root)
    _train(manager, progress, weights, range(1, 5))
    here = _folder(root, rank, manager)
    other = 1 - rank
    assert sorted(p.name for p in here.iterdir()) == sorted(
        [snapshot_name(rank, s, "own") for s in (3, 4)] + [snapshot_name(other, s, "replica") for s in (3, 4)]
    )
    dist.barrier()

    # Rank 1's step 4 is gone everywhere (a kill between the publications): both ranks resume step 3.
    if rank == 1:
        (here / snapshot_name(1, 4, "own")).unlink()
    else:
        (here / snapshot_name(1, 4, "replica")).unlink()
    dist.barrier()
    manager, progress, weights, steps = _restart(root)
    assert steps == [3, 3], steps
    assert progress.step == 3 and torch.equal(weights.w, _value(3, rank, (4, 6), torch.float32))
    assert torch.equal(weights.h, _value(3, rank, (5,), torch.bfloat16))

    # A replaced node: rank 1's folder emptied, its state comes from rank 0's replica.
    _train(manager, progress, weights, range(4, 7))
    dist.barrier()
    if rank == 1:
        for path in here.iterdir():
            path.unlink()
    dist.barrier()
    manager, progress, weights, steps = _restart(root)
    assert steps == [6, 6] and torch.equal(weights.w, _value(6, rank, (4, 6), torch.float32))

    # Another layout (the same tensors here, as tp2 could not hold them): never used; the disk and DCP reshard.
    manager, progress, weights, steps = _restart(root, layout={**LAYOUT, "dp": 1, "tp": 2})
    assert steps == [None, None] and progress.step == 0
    _train(manager, progress, weights, range(5, 7))  # steps 5-6 under that layout, for the next check to remove
    dist.barrier()

    # Nothing newer than the disk checkpoint: every rank falls back, and the stale files are gone.
    manager, progress, weights, steps = _restart(root, disk_step=6)
    assert steps == [None, None] and progress.step == 0 and not list(here.iterdir())

    # Both copies of rank 0's step 8 torn (as a kill mid-write would leave a file, truncated), and a temporary file
    # of step 9 left: every rank resumes step 7, and the temporary file is gone.
    _train(manager, progress, weights, range(7, 9))
    dist.barrier()
    torn = (here / snapshot_name(0, 8, "own")) if rank == 0 else (here / snapshot_name(0, 8, "replica"))
    torn.write_bytes(torn.read_bytes()[:-100])
    (here / f".tmp-{snapshot_name(rank, 9, 'own')}").write_bytes(b"half")
    dist.barrier()
    manager, progress, weights, steps = _restart(root)
    assert steps == [7, 7] and torch.equal(weights.w, _value(7, rank, (4, 6), torch.float32))
    assert not list(here.glob(".tmp-*"))


class _Watched:
    """A file being written whose every write first checks that its snapshot's final name does not exist yet."""

    def __init__(self, path: Path, file):
        self.final, self.file = path.parent / path.name.removeprefix(".tmp-"), file

    def write(self, data) -> int:
        assert not self.final.exists(), f"{self.final} was published before its bytes were written"
        return self.file.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *failure) -> None:
        self.file.close()


def _check_full_folder(root: Path, mesh: DeviceMesh) -> None:
    """A snapshot's final name appears only once its bytes are written. Rank 1's folder is full at step 3: no file
    of step 3 is published on any rank, and snapshots stop everywhere."""
    rank = dist.get_rank()
    open_new = snapshots.open_new
    snapshots.open_new = lambda path: _Watched(path, open_new(path))
    manager, progress, weights = _build(root)
    _train(manager, progress, weights, range(1, 3))
    if rank == 1:
        snapshots.free_bytes = lambda folder: 0
    _train(manager, progress, weights, range(3, 5))
    here = _folder(root, rank, manager)
    assert not manager.enabled and not manager.due(5, 10)
    assert sorted(p.name for p in here.iterdir()) == sorted(
        [snapshot_name(rank, 2, "own"), snapshot_name(1 - rank, 2, "replica"),
         snapshot_name(rank, 1, "own"), snapshot_name(1 - rank, 1, "replica")]
    )  # fmt: skip
    manager.close(finished=True)
    assert not here.exists()


def _check_normal_end(root: Path, mesh: DeviceMesh) -> None:
    manager, progress, weights = _build(root)
    _train(manager, progress, weights, range(1, 3))
    manager.close(finished=True)
    assert not _folder(root, dist.get_rank(), manager).exists()


def test_restarts_agree_on_one_step_use_replicas_and_never_a_torn_file(tmp_path):
    spawn(functools.partial(_check_restarts, tmp_path), world_size=2, store_path=tmp_path / "store")


def test_a_full_folder_turns_snapshots_off_everywhere_without_publishing_that_step(tmp_path):
    spawn(functools.partial(_check_full_folder, tmp_path), world_size=2, store_path=tmp_path / "store")


def test_a_run_that_ends_normally_removes_its_snapshots(tmp_path):
    spawn(functools.partial(_check_normal_end, tmp_path), world_size=2, store_path=tmp_path / "store")
