"""tests/launch.py's one rerun of a job whose rank glibc aborted on a corrupted heap (docs/testing.md, "Heap aborts
under gloo"): only for glibc's heap messages, from the folder as it was, with a warning, and only once."""

import subprocess
from pathlib import Path

import pytest

from tests import launch

ABORT = "[rank0] step 3 | loss 7.61\n\nmalloc(): unaligned tcache chunk detected\nerror (rank 1): communication failed"


@pytest.mark.parametrize(
    "line",
    [
        "malloc(): unaligned tcache chunk detected",
        "free(): invalid pointer",
        "double free or corruption (out)",
        "corrupted size vs. prev_size",
        "malloc_consolidate(): invalid chunk size",
        "munmap_chunk(): invalid pointer",
    ],
)
def test_glibc_heap_messages_are_recognised(line):
    assert launch.heap_abort(f"[rank0] step 1\n{line}\nerror (rank 1): peer died") == line


@pytest.mark.parametrize(
    "output",
    ["Segmentation fault", "RuntimeError: free() is not a model key", "ConfigError: malloc() is no key", "loss nan"],
)
def test_other_failures_are_not_heap_aborts(output):
    assert launch.heap_abort(output) is None


def fake_runs(monkeypatch, folder: Path, outputs: list[tuple[int, str]]) -> list[list[str]]:
    """run_entry replaced by jobs that each add a file to `folder` and end as `outputs` says; returns, per run,
    the folder's files it found."""
    seen: list[list[str]] = []

    def run_entry(entry, argv, nproc, timeout, launcher):
        seen.append(sorted(path.name for path in folder.iterdir()) if folder.exists() else [])
        folder.mkdir(exist_ok=True)
        (folder / f"written-by-run-{len(seen)}").touch()
        code, output = outputs[len(seen) - 1]
        return subprocess.CompletedProcess(argv, code, "", output)

    monkeypatch.setattr(launch, "run_entry", run_entry)
    return seen


def test_a_heap_abort_reruns_once_from_the_folder_as_it_was(monkeypatch, tmp_path):
    folder = tmp_path / "job"
    folder.mkdir()
    (folder / "checkpoint-placed-by-the-test").touch()
    seen = fake_runs(monkeypatch, folder, [(-6, ABORT), (0, "")])
    with pytest.warns(UserWarning, match="unaligned tcache chunk"):
        result = launch.run_train([], 2, folder)
    assert result.returncode == 0
    assert seen == [["checkpoint-placed-by-the-test"], ["checkpoint-placed-by-the-test"]]


def test_a_second_abort_and_other_failures_are_the_result(monkeypatch, tmp_path):
    seen = fake_runs(monkeypatch, tmp_path / "twice", [(-6, ABORT), (-6, ABORT), (0, "")])
    with pytest.warns(UserWarning):
        assert launch.run_train([], 2, tmp_path / "twice").returncode == -6
    assert len(seen) == 2
    seen = fake_runs(monkeypatch, tmp_path / "other", [(1, "ConfigError: bad key"), (0, "")])
    assert launch.run_train([], 2, tmp_path / "other").returncode == 1
    assert len(seen) == 1
