"""The trust boundary of a checkpoint folder, without a training job (docs/security.md): its `.metadata` runs no code
and names no file outside the folder, a torchpre checkpoint holds nothing pickled, non-tensor entries of older or
foreign checkpoints load as plain values only (or, opted in, with full pickle), every file is checked before it is
read, a signed checkpoint loads only under its key, and torchpre deletes only what it made.

The payloads only append a line to a marker file in the test's folder: a test passes when the marker stays absent.
The end-to-end versions, through every entry point, are in tests/integration/test_security.py."""

import dataclasses
import json
import logging
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.hostile import Payload, legacy_checkpoint, remove_file, replace_metadata, rewrite_manifest
from tests.unit.test_checkpoint_integrity import _components, _loaded_step, _manager, _save, _Value
from torchpre.checkpoint.folders import MARKER, complete_steps, publish, remove_unfinished
from torchpre.checkpoint.integrity import MANIFEST, FileCheck, Trust, read_manifest, read_signing_key
from torchpre.checkpoint.metadata_json import METADATA_JSON
from torchpre.checkpoint.metadata_pickle import read_pickled_metadata
from torchpre.checkpoint.reader import read_metadata
from torchpre.checkpoint.values import VALUES
from torchpre.confined import confined_path
from torchpre.errors import TorchpreError


@pytest.fixture
def saved(world, tmp_path) -> Path:
    """A genuine checkpoint of the toy components at step 2."""
    _save(tmp_path / "checkpoint", 2)
    return tmp_path / "checkpoint" / "step-2"


def test_a_torchpre_checkpoint_holds_nothing_pickled_but_dcp_metadata(saved):
    """Every non-tensor value is in state.json, readable; DCP's files hold tensors only, and its metadata is in
    metadata.json too (tests/unit/test_checkpoint_metadata.py), which the manifest lists."""
    assert METADATA_JSON in json.loads((saved / MANIFEST).read_text())["files"]
    metadata = read_metadata(saved, FileCheck(saved))
    assert {type(entry).__name__ for entry in metadata.state_dict_metadata.values()} == {"TensorStorageMetadata"}
    values = json.loads((saved / VALUES).read_text())
    assert values["train.step"] == 2 and values["dataloader.consumed_samples"] == 0
    assert values["lr_scheduler.base_lrs"] == [0.1]


def test_the_metadata_interpreter_reads_genuine_metadata_as_plain_pickle_does(saved):
    data = (saved / ".metadata").read_bytes()
    assert read_pickled_metadata(data, saved / ".metadata") == pickle.loads(data)


@pytest.mark.parametrize("manifest", ["recomputed", "stale"])
def test_code_in_the_metadata_never_runs(saved, tmp_path, manifest):
    marker = tmp_path / "marker"
    replace_metadata(saved, lambda metadata: setattr(metadata, "planner_data", Payload(marker)))
    if manifest == "recomputed":
        rewrite_manifest(saved)
    with pytest.raises(TorchpreError) as error:
        _manager(saved.parent).load(saved)
    expected = "it names builtins.exec" if manifest == "recomputed" else f"is corrupt: {saved / '.metadata'} has"
    assert expected in str(error.value) and str(saved / ".metadata") in str(error.value)
    assert not marker.exists()


def test_metadata_of_another_type_is_refused(saved):
    remove_file(saved, METADATA_JSON)
    (saved / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    rewrite_manifest(saved)
    with pytest.raises(TorchpreError, match="it holds a dict, not DCP's Metadata"):
        read_metadata(saved, FileCheck(saved))


@pytest.mark.parametrize("name", ["../other/__0_0.distcp", "/etc/passwd", "sub/__0_0.distcp", "link.distcp"])
def test_storage_files_outside_the_folder_are_refused(saved, tmp_path, name):
    """The victim: another run's checkpoint beside this one, or any file a link leads to."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "__0_0.distcp").write_bytes((saved / "__0_0.distcp").read_bytes())
    os.symlink(other / "__0_0.distcp", saved / "link.distcp")

    def point_elsewhere(metadata):
        for info in metadata.storage_data.values():
            info.relative_path = name

    replace_metadata(saved, point_elsewhere)
    rewrite_manifest(saved)
    with pytest.raises(TorchpreError, match=r"storage_data\[.*\]\.relative_path") as error:
        _manager(saved.parent).load(saved)
    assert repr(name) in str(error.value)


def test_older_non_tensor_entries_load_as_plain_values(saved):
    legacy_checkpoint(saved, "train.step", 2)
    assert _loaded_step(_manager(saved.parent), saved) == 2


def test_code_in_a_non_tensor_entry_never_runs(saved, tmp_path):
    marker = tmp_path / "marker"
    legacy_checkpoint(saved, "train.step", Payload(marker))
    with pytest.raises(TorchpreError, match="'train.step'.*checkpoint.allow_pickle = true"):
        _manager(saved.parent).load(saved)
    assert not marker.exists()


def test_allow_pickle_loads_a_foreign_entry_with_a_warning_naming_the_folder(saved, caplog):
    """numpy's integer is no plain value to torch's weights-only unpickler: refused, then loaded when opted in."""
    legacy_checkpoint(saved, "train.step", np.int64(2))
    with pytest.raises(TorchpreError, match="'train.step'"):
        _manager(saved.parent).load(saved)
    opted_in = _manager(saved.parent)
    opted_in.settings = dataclasses.replace(opted_in.settings, allow_pickle=True)
    with caplog.at_level(logging.WARNING, logger="torchpre"):
        assert _loaded_step(opted_in, saved) == 2
    assert f"checkpoint.allow_pickle = true: loading {saved} with full pickle" in caplog.text


def test_no_file_is_read_before_the_manifest_vouches_for_it(saved, tmp_path):
    """A check of one file names it; the folder's other files are never opened (a damaged data file is not touched
    when only state.json is read, and state.json altered after the save is refused before it is parsed)."""
    (saved / VALUES).write_text((saved / VALUES).read_text().replace('"train.step": 2', '"train.step": 7'))
    with pytest.raises(TorchpreError, match=f"{VALUES} fails its CRC-32 check"):
        FileCheck(saved).require(VALUES)
    unlisted = saved / "extra.distcp"
    unlisted.write_bytes(b"x")
    with pytest.raises(TorchpreError, match="extra.distcp is not in its manifest.json"):
        FileCheck(saved).require("extra.distcp")


@pytest.mark.parametrize(
    "name, why",
    [("../outside", "climbs out of the folder with '..'"), ("a/../b", "climbs out of the folder with '..'"),
     ("/etc/passwd", "is an absolute path"), ("C:\\x", "is an absolute path"),
     ("link/passwd", "is, or leads through, a symbolic link"), ("", "is not a file name")],
)  # fmt: skip
def test_confined_path_refuses_names_leaving_the_folder(tmp_path, name, why):
    folder = tmp_path / "folder"
    folder.mkdir()
    os.symlink("/etc", folder / "link")
    with pytest.raises(TorchpreError) as error:
        confined_path(folder, name, folder / "index.json", "weight_map['w']")
    assert f"index.json: weight_map['w'] names {name!r}, which {why}" in str(error.value)


def test_confined_path_accepts_names_inside(tmp_path):
    (tmp_path / "sub").mkdir()
    assert confined_path(tmp_path, "sub/x.bin", tmp_path / "index.json", "e") == tmp_path / "sub" / "x.bin"
    assert confined_path(tmp_path, "x..y.bin", tmp_path / "index.json", "e") == tmp_path / "x..y.bin"


def test_a_manifest_naming_a_file_outside_its_folder_is_refused(saved):
    manifest = json.loads((saved / MANIFEST).read_text())
    manifest["files"]["../../secret"] = {"size": 1, "crc32": 0}
    (saved / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(TorchpreError, match=r"files\['../../secret'\] names"):
        read_manifest(saved)


# Signing ----------------------------------------------------------------------------------------------------------


def _signing(folder: Path, key_file: Path):
    checkpoints = _manager(folder)
    checkpoints.trust = Trust(signing_key=key_file.read_bytes().strip())
    return checkpoints


@pytest.fixture
def key(tmp_path) -> Path:
    (tmp_path / "key").write_text("0123456789abcdef0123456789abcdef\n")
    return tmp_path / "key"


def test_a_signed_checkpoint_loads_under_its_key(world, tmp_path, key):
    signer = _signing(tmp_path / "checkpoint", key)
    signer.components["train"].values["step"] = 2
    signer.save(2)
    step_dir = tmp_path / "checkpoint" / "step-2"
    manifest = json.loads((step_dir / MANIFEST).read_text())
    assert len(manifest["signature"]) == 64 and all(len(f["sha256"]) == 64 for f in manifest["files"].values())
    assert _loaded_step(_signing(tmp_path / "checkpoint", key), _signing(tmp_path / "checkpoint", key).find(2)) == 2


@pytest.mark.parametrize("tampering", ["unsigned", "other key", "file altered", "file altered, manifest recomputed"])
def test_a_checkpoint_not_signed_with_the_key_is_refused(world, tmp_path, key, tampering):
    folder = tmp_path / "checkpoint"
    other_key = tmp_path / "other_key"
    other_key.write_text("fedcba9876543210fedcba9876543210")
    if tampering == "unsigned":
        _save(folder, 2)
    else:
        signer = _signing(folder, other_key if tampering == "other key" else key)
        signer.components["train"].values["step"] = 2
        signer.save(2)
    step_dir = folder / "step-2"
    if tampering.startswith("file altered"):
        (step_dir / VALUES).write_text((step_dir / VALUES).read_text().replace('"train.step": 2', '"train.step": 9'))
    if tampering.endswith("recomputed"):
        rewrite_manifest(step_dir)  # CRC-32 and size recomputed; the signature cannot be without the key
    expected = {
        "unsigned": "it is not signed",
        "other key": "its signature does not match this key",
        "file altered": f"{step_dir / VALUES} fails its SHA-256 check",
        "file altered, manifest recomputed": "its signature does not match this key",
    }[tampering]
    with pytest.raises(TorchpreError, match=expected):
        _signing(folder, key).find(2)


def test_a_short_or_missing_key_file_is_refused(tmp_path):
    (tmp_path / "short").write_text("abc")
    with pytest.raises(TorchpreError, match="holds 3 bytes; a key needs at least 16"):
        read_signing_key(str(tmp_path / "short"))
    with pytest.raises(TorchpreError, match="checkpoint.signing_key_file = .*cannot be read"):
        read_signing_key(str(tmp_path / "missing"))


# Deleting only what torchpre made ---------------------------------------------------------------------------------


def test_the_clean_up_removes_only_marked_unfinished_saves(world, tmp_path, caplog):
    """A user's `.tmp-notes` and a `.tmp-step-9` without the marker stay, and so does what a `.tmp-` link leads to;
    the log names what was removed and what was left, and says nothing else was."""
    folder = tmp_path / "checkpoint"
    _save(folder, 2)
    ours = folder / ".tmp-step-4"
    ours.mkdir()
    (ours / MARKER).touch()
    (folder / ".tmp-notes").mkdir()
    (folder / ".tmp-notes" / "notes.txt").write_text("mine\n")
    (folder / ".tmp-step-9").mkdir()
    (folder / ".tmp-step-9" / "data").write_text("not torchpre's\n")
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / MARKER).touch()
    (victim / "keep.txt").write_text("keep\n")
    os.symlink(victim, folder / ".tmp-step-8")
    with caplog.at_level(logging.INFO, logger="torchpre"):
        removed = remove_unfinished(folder)
    assert removed == [ours] and not ours.exists()
    assert (folder / ".tmp-notes" / "notes.txt").read_text() == "mine\n"
    assert (folder / ".tmp-step-9" / "data").exists() and (victim / "keep.txt").exists()
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("removed")] == [
        f"removed {ours}, left by a save or deletion that did not finish"
    ]
    assert sum(r.getMessage().startswith("left ") for r in caplog.records) == 3


def test_publishing_over_an_existing_step_moves_it_aside_and_says_where(world, tmp_path, caplog):
    folder = tmp_path / "checkpoint"
    _save(folder, 2)
    old = {path.name: path.read_bytes() for path in (folder / "step-2").iterdir()}
    new = folder / ".tmp-step-2"
    new.mkdir()
    with caplog.at_level(logging.WARNING, logger="torchpre"):
        replaced = publish(new, folder / "step-2")
    assert replaced == folder / "replaced-step-2"
    assert {path.name: path.read_bytes() for path in replaced.iterdir()} == old
    assert f"moved it aside to {replaced}" in caplog.text
    assert complete_steps(folder) == [2] and not any((folder / "step-2").iterdir())


def test_retention_never_counts_or_removes_folders_moved_aside(world, tmp_path):
    folder = tmp_path / "checkpoint"
    _save(folder, 2)
    (folder / "step-2").rename(folder / "damaged-step-2")
    checkpoints = _manager(folder, components=_components())
    checkpoints.steps.keep_latest_k = 1
    for step in (4, 6):
        checkpoints.components["train"].values["step"] = step
        checkpoints.save(step)
    assert sorted(path.name for path in folder.iterdir()) == ["damaged-step-2", "step-6"]


def test_the_values_of_a_component_must_be_plain(world, tmp_path):
    checkpoints = _manager(tmp_path, components=_components() | {"train": _value_of(torch.Size([2]))})
    assert checkpoints.save(2)  # a torch.Size is a tuple: JSON holds it as a list
    broken = _manager(tmp_path / "b", components=_components() | {"train": _value_of(Path("x"))})
    with pytest.raises(TypeError, match="'train.step' holds PosixPath"):
        broken.save(2)


def _value_of(value: object) -> _Value:
    return _Value(step=value)
