"""convert's writer (`write_whole`) runs the published-folder life of checkpoints and exports: its output appears
only complete and holds its own files only, a failed write leaves nothing behind, and nothing it did not make (a
temporary folder that lost torchpre's marker) is removed."""

import logging
import shutil
from pathlib import Path

import pytest

from torchpre.checkpoint.folders import MARKER
from torchpre.checkpoint.published import UNFINISHED_OUTPUT, write_whole


def _write_weights(folder: Path) -> None:
    (folder / "model.safetensors").write_bytes(b"weights")


@pytest.mark.parametrize("target_exists", [False, True], ids=["new", "empty-folder"])
def test_the_output_appears_whole_without_the_marker_and_replaces_an_empty_folder(tmp_path, target_exists):
    target = tmp_path / "hf"
    if target_exists:
        target.mkdir()
    seen = []

    def write(folder: Path) -> None:
        seen.append((folder.name, sorted(path.name for path in folder.iterdir()), target.exists()))
        _write_weights(folder)

    write_whole(target, write)
    ((name, contents, target_seen),) = seen
    assert UNFINISHED_OUTPUT.match(name) and name.startswith(".tmp-hf-")
    assert contents == [MARKER] and target_seen == target_exists  # marked before anything is written; not yet hf
    assert [path.name for path in tmp_path.iterdir()] == ["hf"]
    assert [path.name for path in target.iterdir()] == ["model.safetensors"]


def test_a_failed_write_leaves_nothing_and_raises(tmp_path):
    def full(folder: Path) -> None:
        _write_weights(folder)
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_whole(tmp_path / "hf", full)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_leaves_a_folder_that_lost_torchpres_marker(tmp_path, caplog):
    """Swapped for an unmarked folder during the write (anyone's): it stays, named in a warning."""
    swapped = []

    def swapped_then_full(folder: Path) -> None:
        shutil.rmtree(folder)
        folder.mkdir()
        (folder / "theirs.txt").write_text("not torchpre's\n")
        swapped.append(folder)
        raise OSError(28, "No space left on device")

    with caplog.at_level(logging.WARNING, logger="torchpre"), pytest.raises(OSError, match="No space left"):
        write_whole(tmp_path / "hf", swapped_then_full)
    (folder,) = swapped
    assert (folder / "theirs.txt").read_text() == "not torchpre's\n"
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"left {folder} in place: it lacks torchpre's marker {MARKER}, so torchpre did not make it (remove it "
        "yourself if unwanted)"
    ]
