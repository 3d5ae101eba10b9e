"""A node lost mid-run resumes from the in-memory snapshots (checkpoint.memory_interval = 1), bit for bit: two torchrun
agents as two nodes on this machine (`--nnodes 2:2`, each with a snapshot folder of its own, as two hosts' /dev/shm),
one killed with its workers during a step at least 20 steps after the last disk checkpoint (none is written before
the last step), and a replacement started with the same command. The job resumes from the step before the one in
progress, trains no step twice, and its per-step losses and final checkpoint equal an uninterrupted run's bitwise;
with the killed node's folder emptied (a replaced node) its ranks restore from their peers' replicas, and a torn
snapshot of the step after (a half-written file) is never used."""

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.integration.test_elastic import Node, nodes  # noqa: F401 (the fixture)
from tests.integration.test_faults import records_by_step
from tests.launch import TINY, read_checkpoint, run_train
from torchpre.checkpoint.snapshots.file_format import parse_name, snapshot_name
from torchpre.checkpoint.state import flatten

STEPS = 24
KILL_AFTER = 20  # the kill comes during a step after this one, which is that many steps after the run's start
ARGS = [*TINY, "--training.steps", str(STEPS), "--training.global_batch_size", "8", "--training.deterministic",
        "--checkpoint.enable", "--checkpoint.interval", "1000"]  # fmt: skip
LAYOUTS = {
    "dp2_zero3": (1, ["--optimizer.zero_stage", "3"]),
    "tp2_pp2": (2, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.pipeline_parallel_degree", "2"]),
}


def _snapshot_args(folder: Path) -> list[str]:
    return ["--checkpoint.memory_interval", "1", "--checkpoint.memory_folder", str(folder)]


def _published(folders: list[Path], world_size: int) -> int:
    """The newest step whose snapshot every rank has published (own or replica), -1 if none."""
    held: dict[int, set[int]] = {}
    for folder in folders:
        for path in folder.glob("*/*"):
            parsed = parse_name(path.name)
            if parsed is not None:
                held.setdefault(parsed[1], set()).add(parsed[0])
    complete = [step for step, ranks in held.items() if len(ranks) == world_size]
    return max(complete, default=-1)


def _logged(run: Path) -> int:
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return len(lines)


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _freeze_during_a_step(first: Node, second: Node, nproc: int, run: Path, folders: list[Path]) -> tuple[int, list]:
    """Stops every worker (SIGSTOP) once the job is in a step after KILL_AFTER whose predecessor is published on
    every rank and logged, and not yet logged itself: the moment of a kill during that step. Returns the step
    before it and the stopped workers."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if _logged(run) > KILL_AFTER and _published(folders, 2 * nproc) >= KILL_AFTER:
            workers = first.workers(nproc) + second.workers(nproc)
            _signal(workers, signal.SIGSTOP)
            logged, published = _logged(run), _published(folders, 2 * nproc)
            if logged == published:
                return published, workers
            _signal(workers, signal.SIGCONT)
        if first.process.poll() is not None:
            pytest.fail(f"the job ended before the kill:\n{first.output()[-3000:]}")
        time.sleep(0.005)
    pytest.fail(f"no moment to kill in 240 s:\n{first.output()[-3000:]}")


def _tear_the_next_step(folder: Path, step: int) -> None:
    """A half-written snapshot of step + 1 under the final name of every file of `step` in `folder` (as a kill
    during its write could leave, were files not published by rename): the step looks complete, and must not be
    used."""
    for path in list(folder.glob(f"*/rank*-step{step}.*")):
        rank, _ = parse_name(path.name)
        kind = path.suffix[1:]
        data = path.read_bytes()
        (path.parent / snapshot_name(rank, step + 1, kind)).write_bytes(data[: len(data) // 2])


def _assert_same_state(run: Path, reference: Path) -> None:
    """The final checkpoints hold the same entries, every tensor bitwise equal and every value equal, the RNG states
    included (the loader draws its iterators' seeds from a generator of its own, torchpre/data/loader.py)."""
    ours, theirs = (flatten(read_checkpoint(folder / "checkpoint" / f"step-{STEPS}")) for folder in (run, reference))
    assert ours.keys() == theirs.keys()
    for key, value in ours.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, theirs[key]), key
        else:
            assert value == theirs[key], key


CASES = [
    pytest.param("dp2_zero3", True, id="dp2_zero3-emptied"),
    pytest.param("dp2_zero3", False, id="dp2_zero3", marks=pytest.mark.snapshot_matrix),
    pytest.param("tp2_pp2", False, id="tp2_pp2", marks=pytest.mark.snapshot_matrix),
    pytest.param("tp2_pp2", True, id="tp2_pp2-emptied", marks=pytest.mark.snapshot_matrix),
]


@pytest.mark.parametrize(("layout", "emptied"), CASES)
def test_a_killed_node_resumes_from_the_snapshots_of_the_step_before_bitwise(nodes, tmp_path, layout, emptied):  # noqa: F811
    nproc, layout_args = LAYOUTS[layout]
    reference = tmp_path / "reference"
    result = run_train([*ARGS, *layout_args], 2 * nproc, reference, launcher="torchrun")
    assert result.returncode == 0, result.stderr[-3000:]

    run, folders = tmp_path / "run", [tmp_path / "shm-node0", tmp_path / "shm-node1"]
    args = [*ARGS, *layout_args, "--job.dump_folder", str(run)]
    first = nodes("node0", nproc, [*args, *_snapshot_args(folders[0])], host=True, nnodes="2:2")
    second = nodes("node1", nproc, [*args, *_snapshot_args(folders[1])], host=False, nnodes="2:2")
    step, workers = _freeze_during_a_step(first, second, nproc, run, folders)
    assert step >= KILL_AFTER
    second.kill()
    if emptied:
        for path in folders[1].glob("*/*"):
            path.unlink()
    _tear_the_next_step(folders[0], step)
    _signal(workers, signal.SIGCONT)  # the survivors find their peers gone, and torchrun restarts them
    replacement = nodes("node1-replacement", nproc, [*args, *_snapshot_args(folders[1])], host=False, nnodes="2:2")
    assert first.wait() == 0, first.output()[-3000:]
    assert replacement.wait() == 0, replacement.output()[-3000:]

    # torchrun's rendezvous may number the nodes the other way after the restart: rank 0, which logs the restore, is
    # then the replacement's (the cause of this check's two failures in CI, 2026-12-07).
    output = first.output() + replacement.output()
    peers = nproc if emptied else 0
    assert (
        f"resumed from the in-memory snapshots of step {step} (newer than the disk checkpoint's step 0); {peers} "
        "rank(s) restored from a peer's replica" in output
    ), output[-3000:]
    assert f"at step {step + 1} is not used" in output  # the torn files
    expected = records_by_step(reference)
    records = records_by_step(run)
    assert sorted(records) == list(range(1, STEPS + 1))
    assert [records[s]["loss"] for s in records] == [expected[s]["loss"] for s in records]
    _assert_same_state(run, reference)
    assert not [path for folder in folders for path in folder.glob("*/*")]  # removed at the normal end
