"""The Hugging Face exporter in one process, without a training job: what it writes equals the family's mapping of
the model's state dict bitwise, a `step-N` folder never exists while its files are being written, retention keeps
the newest, the clean-up removes only torchpre's unfinished exports, a failed write publishes nothing (and removes no
folder torchpre did not make), and the tensors' owners split the bytes among the ranks holding them (the multi-rank
layouts, against transformers, are in tests/integration/test_hf_export_eval.py)."""

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import torchpre.interchange.export as hf_export
from torchpre.checkpoint.folders import MARKER
from torchpre.config.job_config import HFExport
from torchpre.data.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer
from torchpre.errors import StorageError, UntrustedInput
from torchpre.interchange.export import HFExporter, TensorInfo, _balanced_owners
from torchpre.models.registry import get_model_spec

TOKENIZER = load_tokenizer(DEFAULT_TOKENIZER_PATH)


def _exporter(
    folder: Path, flavor: str = "tiny", family: str = "llama3", args: dict | None = None, **settings
) -> tuple[HFExporter, Any]:
    spec = get_model_spec(family)
    args = dataclasses.replace(spec.flavors[flavor], vocab_size=TOKENIZER.vocab_size, max_seq_len=32, **(args or {}))
    with torch.device("meta"):
        model = spec.build.model_cls(args)
    model.to_empty(device="cpu")
    spec.build.init_weights(model, 0)
    parallel = SimpleNamespace(parts=[model])  # what the exporter asks of a ParallelModel
    exporter = HFExporter(folder, HFExport(enable=True, **settings), parallel, spec, args, TOKENIZER, 32)
    return exporter, model


@pytest.mark.parametrize(
    "family, flavor, args",
    [
        ("llama3", "tiny", {}),
        ("llama3", "debugmodel_tied", {}),
        ("deepseek_v3", "debugmodel", {"bias_update_rate": 0.0}),
    ],
    ids=["llama3", "tied", "deepseek_v3"],
)
def test_the_export_is_the_familys_mapping_of_the_state_dict_bitwise(world, tmp_path, family, flavor, args):
    """Tied embeddings (the output copy left out) and DeepSeek-V3 (experts unstacked; without bias balancing a zero
    router bias that the adapter makes from nothing, which rank 0 writes)."""
    exporter, model = _exporter(tmp_path, flavor, family, args, async_mode="disabled")
    exporter.export(3)
    step_dir = tmp_path / "step-3"
    expected = get_model_spec(family).hf.to_hf_state_dict(model.state_dict(), model.args)
    written = load_file(step_dir / "model.safetensors")
    assert written.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(written[name], tensor), name
    assert json.loads((step_dir / "config.json").read_text())["tie_word_embeddings"] == model.args.tie_word_embeddings
    assert sorted(path.name for path in step_dir.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.model", "tokenizer_config.json",
    ]  # fmt: skip


def test_no_step_folder_exists_while_its_files_are_written(world, tmp_path, monkeypatch):
    """In the background: while the weights are written, only `.tmp-step-2` exists; then `step-2`, complete."""
    seen = []
    save = hf_export.save_safetensors

    def watched_save(tensors, path):
        seen.append(sorted(p.name for p in tmp_path.iterdir()))
        save(tensors, path)

    monkeypatch.setattr(hf_export, "save_safetensors", watched_save)
    exporter, _ = _exporter(tmp_path)
    exporter.export(2)
    exporter.wait()
    assert seen == [[".tmp-step-2"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2"]
    assert (tmp_path / "step-2" / "model.safetensors").is_file()
    exporter.close()


def test_retention_keeps_the_newest_and_a_restart_removes_unfinished_exports(world, tmp_path):
    (tmp_path / ".tmp-step-1").mkdir(parents=True)
    (tmp_path / ".tmp-step-1" / MARKER).touch()
    exporter, _ = _exporter(tmp_path, keep_latest_k=2)
    exporter.remove_unfinished()
    for step in (2, 4, 6):
        exporter.export(step)
    exporter.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4", "step-6"]


def test_the_clean_up_removes_only_marked_unfinished_exports_and_follows_no_link(world, tmp_path, caplog):
    """A `.tmp-step-3` without torchpre's marker (a crashed export of an older torchpre, or anyone's folder), a
    `.tmp-x` folder and a `.tmp-step-5` link to a marked folder elsewhere all stay, each named in a warning; what the
    link leads to is untouched. A marked `.tmp-step-1` is removed."""
    ours, unmarked, other = tmp_path / ".tmp-step-1", tmp_path / ".tmp-step-3", tmp_path / ".tmp-x"
    for folder in (ours, unmarked, other):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"weights")
    (ours / MARKER).touch()
    (other / MARKER).touch()
    victim = tmp_path.parent / f"{tmp_path.name}-victim"
    victim.mkdir()
    (victim / MARKER).touch()
    os.symlink(victim, tmp_path / ".tmp-step-5")
    exporter, _ = _exporter(tmp_path)
    with caplog.at_level(logging.INFO, logger="torchpre"):
        exporter.remove_unfinished()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-step-3", ".tmp-step-5", ".tmp-x"]
    assert (unmarked / "model.safetensors").read_bytes() == b"weights" and (victim / MARKER).is_file()
    left = sorted(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert left == [
        f"left {unmarked} in place: it lacks torchpre's marker {MARKER}, so torchpre did not make it (remove it "
        "yourself if unwanted)",
        f"left {tmp_path / '.tmp-step-5'} in place: it is a symbolic link, so torchpre did not make it (remove it "
        "yourself if unwanted)",
        f"left {other} in place: its name is not one torchpre gives its unfinished checkpoints, so torchpre did not "
        "make it (remove it yourself if unwanted)",
    ]
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("removed")] == [
        f"removed {ours}, left by a save or deletion that did not finish"
    ]


def test_an_unfinished_export_torchpre_did_not_make_stops_the_export_of_its_step(world, tmp_path):
    """A `.tmp-step-2` link to a folder elsewhere is in the way of step 2's export: the export refuses it, naming it,
    and writes nothing through it."""
    victim = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    victim.mkdir()
    os.symlink(victim, tmp_path / ".tmp-step-2")
    exporter, _ = _exporter(tmp_path)
    in_the_way = f"{tmp_path / '.tmp-step-2'} is in the way of the Hugging Face export of step 2"
    with pytest.raises(UntrustedInput, match=in_the_way):
        exporter.export(2)
    assert list(victim.iterdir()) == [] and (tmp_path / ".tmp-step-2").is_symlink()


def test_a_failed_write_publishes_nothing_and_raises_at_the_next_export(world, tmp_path, monkeypatch):
    def full_disk(tensors, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf_export, "save_safetensors", full_disk)
    exporter, _ = _exporter(tmp_path)
    exporter.export(2)
    with pytest.raises(StorageError, match=r"export of step 2 .* failed \(rank 0: OSError: .*No space left"):
        exporter.export(4)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_export_leaves_a_tmp_folder_that_lost_torchpres_marker(world, tmp_path, monkeypatch, caplog):
    """A failed write removes its `.tmp-step-2` only while torchpre's marker says it is torchpre's: one swapped for an
    unmarked folder during the write (anyone's) stays, named in a warning, and the export's failure is raised."""
    tmp = tmp_path / ".tmp-step-2"

    def swapped_then_full(tensors, path):
        shutil.rmtree(tmp)
        tmp.mkdir()
        (tmp / "theirs.txt").write_text("not torchpre's\n")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf_export, "save_safetensors", swapped_then_full)
    exporter, _ = _exporter(tmp_path, async_mode="disabled")
    with caplog.at_level(logging.WARNING, logger="torchpre"), pytest.raises(StorageError, match="export of step 2"):
        exporter.export(2)
    assert (tmp / "theirs.txt").read_text() == "not torchpre's\n"
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"left {tmp} in place: it lacks torchpre's marker {MARKER}, so torchpre did not make it (remove it yourself "
        "if unwanted)"
    ]


def test_owners_are_holders_and_split_the_bytes():
    """Eight equal tensors held by two ranks and one held by a third: four each, the third owns its own."""
    infos = {f"w{i}": TensorInfo((4, 4), torch.float32, (0, 1)) for i in range(8)}
    infos["norm"] = TensorInfo((4,), torch.float32, (2,))
    owners = _balanced_owners(infos)
    assert owners["norm"] == 2
    assert sorted(owners[f"w{i}"] for i in range(8)) == [0, 0, 0, 0, 1, 1, 1, 1]
