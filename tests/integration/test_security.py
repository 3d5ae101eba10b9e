"""What a file from someone else can do through each entry point (docs/security.md): nothing but be refused.

Each proof of concept is built from a real checkpoint of a 2-step run of the tiny model, and each payload only
appends a line to a marker file in the test's folder. Every load path that reads a step folder (resume, a run's
initial weights, generation, export to Hugging Face) must exit 2 with the refusal, the marker absent and the victim's
files intact. The same refusals without a training job: tests/unit/test_checkpoint_trust.py.
"""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.hostile import (
    Payload,
    legacy_checkpoint,
    legacy_format,
    replace_entry_bytes,
    replace_metadata,
    replace_metadata_json,
    rewrite_manifest,
)
from tests.launch import TINY, manifest_record, run_entry, run_train
from torchpre.checkpoint.integrity import MANIFEST
from torchpre.checkpoint.metadata_json import METADATA_JSON

pytestmark = pytest.mark.slow

EXIT_BAD_INPUT = 2


@pytest.fixture(scope="module")
def genuine(tmp_path_factory) -> Path:
    """A 2-step run of the tiny model, checkpointed at step 2, and its export as a sharded Hugging Face folder."""
    root = tmp_path_factory.mktemp("genuine")
    args = [*TINY, "--training.steps", "2", "--checkpoint.enable", "--checkpoint.interval", "2"]
    result = run_train(args, 1, root / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    step_dir = root / "run" / "checkpoint" / "step-2"
    hf = ["dcp-to-hf", step_dir, root / "hf", "--model.flavor", "tiny", "--max_shard_size", "300KB"]
    assert run_entry("torchpre.convert", list(map(str, hf))).returncode == 0
    return root


def _copy(genuine: Path, tmp_path: Path) -> Path:
    """A copy of the genuine run to tamper with; returns its step-2 folder."""
    shutil.copytree(genuine / "run", tmp_path / "run")
    return tmp_path / "run" / "checkpoint" / "step-2"


# How a step folder is loaded: the entry point and its arguments, given the step folder and a fresh folder.
LOAD_PATHS = {
    "resume": lambda step, out: (
        "train.py",
        [*TINY, "--training.steps", "3", "--checkpoint.enable", "--checkpoint.load_step", "2",
         "--job.dump_folder", str(step.parent.parent)],
    ),
    "initial_load_path": lambda step, out: (
        "train.py",
        [*TINY, "--training.steps", "3", "--checkpoint.initial_load_path", str(step), "--job.dump_folder", str(out)],
    ),
    "generate": lambda step, out: (
        "torchpre.generate",
        ["--model.flavor", "tiny", "--checkpoint.folder", str(step.parent), "--prompt", "hello",
         "--max_new_tokens", "2", "--job.dump_folder", str(out)],
    ),
    "dcp-to-hf": lambda step, out: ("torchpre.convert", ["dcp-to-hf", str(step), str(out), "--model.flavor", "tiny"]),
}  # fmt: skip


def _pickle_in_metadata(step: Path, marker: Path, victim: Path) -> str:
    replace_metadata(step, lambda metadata: setattr(metadata, "planner_data", Payload(marker)))
    rewrite_manifest(step)
    return "it names builtins.exec"


def _pickle_in_metadata_stale_manifest(step: Path, marker: Path, victim: Path) -> str:
    replace_metadata(step, lambda metadata: setattr(metadata, "planner_data", Payload(marker)))
    return f"{step / '.metadata'} has"


def _pickle_in_an_entry(step: Path, marker: Path, victim: Path) -> str:
    """A checkpoint of the older format (non-tensor values pickled by DCP): the RoPE entry holds the payload."""
    legacy_checkpoint(step, "train.rope_theta", Payload(marker))
    return "refused to unpickle the checkpoint entry 'train.rope_theta'"


def _storage_paths_escape(step: Path, marker: Path, victim: Path) -> str:
    """The data of another run's checkpoint (the victim), named from this folder's metadata."""
    victim.mkdir(parents=True)
    shutil.copy(step / "__0_0.distcp", victim / "__0_0.distcp")
    escape = os.path.relpath(victim / "__0_0.distcp", step)

    def point_at_victim(metadata):
        for info in metadata.storage_data.values():
            info.relative_path = escape

    replace_metadata(step, point_at_victim)
    rewrite_manifest(step)
    return "relative_path"


def _metadata_entry_without_chunks(step: Path, marker: Path, victim: Path) -> str:
    """The reviewer's: a tensor whose chunks were dropped from a pickled .metadata loaded as uninitialised memory."""
    replace_metadata(step, lambda metadata: metadata.state_dict_metadata["model.output.weight"].chunks.clear())
    rewrite_manifest(step)
    return "'model.output.weight' has the shape"


def _metadata_json_chunk_gap(step: Path, marker: Path, victim: Path) -> str:
    """A chunk of metadata.json shrunk by a row: the weights' last row would never be read."""

    def shrink(record):
        record["state_dict_metadata"]["model.norm.weight"]["chunks"][0]["sizes"][0] -= 1

    replace_metadata_json(step, shrink)
    rewrite_manifest(step)
    return "'model.norm.weight' has chunks of"


def _storage_file_links_out(step: Path, marker: Path, victim: Path) -> str:
    """The data file is a link to another run's (the victim's), in a folder without a manifest, which only
    checkpoint.allow_unverified loads (EXTRA_ARGS): no manifest check stands between the link and the read."""
    victim.mkdir(parents=True)
    shutil.move(step / "__0_0.distcp", victim / "__0_0.distcp")
    os.symlink(victim / "__0_0.distcp", step / "__0_0.distcp")
    (step / MANIFEST).unlink()
    return f"{step / '__0_0.distcp'} (named by {step / METADATA_JSON}"


def _legacy_format_entry(step: Path, marker: Path, victim: Path) -> str:
    """The reviewer's: a non-tensor entry in torch's legacy format, whose few hundred bytes claim a 2.8 GB storage
    that torch.load allocates before reading."""
    legacy_checkpoint(step, "train.rope_theta", 500000.0)
    replace_entry_bytes(step, "train.rope_theta", legacy_format(torch.zeros(1), numel=700_000_000))
    return "refused to unpickle the checkpoint entry 'train.rope_theta': it is no plain value (it is not in"


def _tensor_in_legacy_format(step: Path, marker: Path, victim: Path) -> str:
    size = json.loads((step / METADATA_JSON).read_text())["state_dict_metadata"]["model.norm.weight"]["size"]
    replace_entry_bytes(step, "model.norm.weight", legacy_format(torch.ones(size), numel=700_000_000))
    return "the entry 'model.norm.weight' (bytes"


PAYLOADS = {
    "pickle-in-metadata": _pickle_in_metadata,
    "pickle-in-metadata-stale-manifest": _pickle_in_metadata_stale_manifest,
    "pickle-in-a-non-tensor-entry": _pickle_in_an_entry,
    "storage-paths-escape": _storage_paths_escape,
    "metadata-entry-without-chunks": _metadata_entry_without_chunks,
    "metadata-json-chunk-gap": _metadata_json_chunk_gap,
    "storage-file-links-out": _storage_file_links_out,
    "legacy-format-entry": _legacy_format_entry,
    "tensor-in-legacy-format": _tensor_in_legacy_format,
}
EXTRA_ARGS = {"storage-file-links-out": ["--checkpoint.allow_unverified"]}
# Payloads that hide in a non-tensor entry, which a run's initial weights (the "model" entry alone) never read.
NON_TENSOR = {"pickle-in-a-non-tensor-entry", "legacy-format-entry"}
# CI runs each payload through one load path and each load path once; -m security runs all 36 pairs.
SAMPLE = [("pickle-in-metadata", "resume"), ("pickle-in-metadata-stale-manifest", "generate"),
          ("pickle-in-a-non-tensor-entry", "dcp-to-hf"), ("storage-paths-escape", "initial_load_path"),
          ("metadata-entry-without-chunks", "dcp-to-hf"), ("metadata-json-chunk-gap", "initial_load_path"),
          ("storage-file-links-out", "generate"), ("legacy-format-entry", "resume"),
          ("tensor-in-legacy-format", "resume")]  # fmt: skip


def _pairs():
    for payload in PAYLOADS:
        for path in LOAD_PATHS:
            marks = () if (payload, path) in SAMPLE else (pytest.mark.security,)
            yield pytest.param(payload, path, id=f"{payload}-{path}", marks=marks)


@pytest.mark.parametrize("payload, load_path", list(_pairs()))
def test_a_hostile_checkpoint_is_refused_by_every_load_path(genuine, tmp_path, payload, load_path):
    step = _copy(genuine, tmp_path)
    marker, victim = tmp_path / "marker", tmp_path / "other-run" / "checkpoint" / "step-2"
    expected = PAYLOADS[payload](step, marker, victim)
    victim_files = {p.name: p.read_bytes() for p in victim.iterdir()} if victim.exists() else {}
    entry, argv = LOAD_PATHS[load_path](step, tmp_path / "out")
    result = run_entry(entry, [*argv, *EXTRA_ARGS.get(payload, [])])
    assert not marker.exists(), "the payload ran"
    if payload in NON_TENSOR and load_path == "initial_load_path":
        assert result.returncode == 0, result.stderr[-3000:]  # it loads the weights alone: the entry is never read
        return
    assert result.returncode == EXIT_BAD_INPUT, result.stderr[-3000:]
    assert expected in result.stderr and "Traceback" not in result.stderr
    if victim_files:
        assert {p.name: p.read_bytes() for p in victim.iterdir()} == victim_files
    assert not list((tmp_path / "out").glob("*.safetensors")), "an export was written"


def test_a_hugging_face_index_naming_another_folder_is_refused(genuine, tmp_path):
    hf = shutil.copytree(genuine / "hf", tmp_path / "hf")
    other = shutil.copytree(genuine / "hf", tmp_path / "other")
    index = hf / "model.safetensors.index.json"
    content = json.loads(index.read_text())
    name = next(iter(content["weight_map"]))
    content["weight_map"][name] = f"../other/{content['weight_map'][name]}"
    index.write_text(json.dumps(content))
    result = run_entry("torchpre.convert", ["hf-to-dcp", str(hf), str(tmp_path / "step-1"), "--model.flavor", "tiny"])
    assert result.returncode == EXIT_BAD_INPUT, result.stderr[-3000:]
    assert f"weight_map[{name!r}] names '../other/" in result.stderr and "climbs out of the folder" in result.stderr
    assert not (tmp_path / "step-1").exists() and sorted(p.name for p in other.iterdir())


@pytest.mark.parametrize("escape", ["relative", "absolute"])
def test_a_shard_manifest_naming_another_folder_is_refused(tmp_path, escape):
    """Folder A's manifest names B's shard: training would run on B's tokens."""
    a, b, text = tmp_path / "A", tmp_path / "B", tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 400)
    assert run_entry("torchpre.data.prepare", [str(text), "--output", str(b)]).returncode == 0
    shutil.copytree(b, a)
    manifest = json.loads((a / "manifest.json").read_text())
    shard = manifest["shards"][0]["name"]
    manifest["shards"][0]["name"] = f"../B/{shard}" if escape == "relative" else str(b / shard)
    (a / "manifest.json").write_text(json.dumps(manifest))
    args = [*TINY, "--training.steps", "1", "--training.dataset", "shards", "--training.dataset_path", str(a)]
    result = run_train(args, 1, tmp_path / "run")
    assert result.returncode == EXIT_BAD_INPUT, result.stderr[-3000:]
    assert f"{a / 'manifest.json'}: shards[0].name names" in result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_run_removes_no_folder_it_did_not_make(tmp_path):
    """checkpoint.folder is a folder of the user's with a `.tmp-notes/` and a `.tmp-step-3` link to their data: both
    stay, and the log names them as left in place, not as removed."""
    folder, data = tmp_path / "mine", tmp_path / "data"
    (folder / ".tmp-notes").mkdir(parents=True)
    (folder / ".tmp-notes" / "notes.txt").write_text("notes\n")
    data.mkdir()
    (data / "keep.txt").write_text("keep\n")
    os.symlink(data, folder / ".tmp-step-3")
    args = [*TINY, "--training.steps", "2", "--checkpoint.enable", "--checkpoint.folder", str(folder)]
    result = run_train(args, 1, tmp_path / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (folder / ".tmp-notes" / "notes.txt").read_text() == "notes\n" and (data / "keep.txt").exists()
    log = result.stdout + result.stderr
    assert "removed" not in log
    assert f"left {folder / '.tmp-notes'} in place" in log
    assert f"left {folder / '.tmp-step-3'} in place: it is a symbolic link" in log
    assert (folder / "step-2" / "manifest.json").is_file()


def test_a_signed_run_resumes_and_an_unsigned_checkpoint_is_refused(genuine, tmp_path):
    key = tmp_path / "key"
    key.write_text("an example key of 32 characters")
    signed = ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.signing_key_file", str(key)]
    first = run_train([*TINY, "--training.steps", "2", *signed], 1, tmp_path / "signed")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_train([*TINY, "--training.steps", "3", *signed], 1, tmp_path / "signed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"loaded {tmp_path / 'signed' / 'checkpoint' / 'step-2'}" in resumed.stdout + resumed.stderr
    unsigned = _copy(genuine, tmp_path / "unsigned")
    refused = run_train([*TINY, "--training.steps", "3", *signed, "--checkpoint.load_step", "2"], 1,
                        unsigned.parent.parent)  # fmt: skip
    assert refused.returncode == EXIT_BAD_INPUT, refused.stderr[-3000:]
    assert "it is not signed, and checkpoint.signing_key_file asks for checkpoints signed" in refused.stderr


def test_manifest_record_matches_what_a_save_writes(genuine):
    """The helper the proofs of concept use recomputes the manifest exactly as a save wrote it."""
    step = genuine / "run" / "checkpoint" / "step-2"
    manifest = json.loads((step / "manifest.json").read_text())
    assert manifest["files"] == {name: manifest_record(step / name) for name in manifest["files"]}
