"""Hostile files built from genuine ones, for the tests of the trust boundary (docs/security.md): each payload only
appends a line to a marker file, so a test passes when the marker stays absent."""

import io
import json
import pickle
import struct
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from tests.launch import manifest_record
from torchpre.checkpoint.integrity import MANIFEST, FileCheck
from torchpre.checkpoint.metadata_json import METADATA_JSON
from torchpre.checkpoint.reader import Loader
from torchpre.checkpoint.values import VALUES


class Payload:
    """Pickles as a call that appends to `marker`: what a hostile checkpoint would hide in a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'a').write('ran\\n')",)


def rewrite_manifest(step_dir: Path) -> None:
    """What anyone can do after altering a folder: recompute every record of its manifest."""
    manifest = json.loads((step_dir / MANIFEST).read_text())
    manifest["files"] = {name: manifest_record(step_dir / name) for name in manifest["files"]}
    (step_dir / MANIFEST).write_text(json.dumps(manifest))


def replace_metadata(step_dir: Path, edit) -> None:
    """Rewrites `.metadata` (plain pickle, as an attacker would) after `edit(metadata)`, and removes `metadata.json`
    from the folder and its manifest: a checkpoint of another tool, or of torchpre before metadata.json, which a load
    reads through `.metadata`."""
    path = step_dir / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    edit(metadata)
    path.write_bytes(pickle.dumps(metadata))
    remove_file(step_dir, METADATA_JSON)


def replace_metadata_json(step_dir: Path, edit) -> None:
    """Rewrites `metadata.json` after `edit(record)` (its parsed JSON); the manifest is left as it was."""
    path = step_dir / METADATA_JSON
    record = json.loads(path.read_text())
    edit(record)
    path.write_text(json.dumps(record))


def legacy_format(tensor: torch.Tensor, numel: int | None = None) -> bytes:
    """`tensor` as torch.save's legacy (pre-1.6) format writes it; with `numel`, its storage claims that many
    elements, which torch.load would allocate before reading a byte. `tensor` holds one element or more."""
    buffer = io.BytesIO()
    torch.save(tensor, buffer, _use_new_zipfile_serialization=False)
    data = buffer.getvalue()
    if numel is not None:  # the storage's key is (..., "cpu", numel, None): BININT1/BININT2/BININT, NONE, TUPLE
        size = pickle.dumps(tensor.numel(), protocol=2)[2:-1] + b"Nt"
        assert data.count(size) == 1, "the storage's size is not where torch 2.x writes it"
        data = data.replace(size, b"J" + struct.pack("<i", numel) + b"Nt")
    return data


def replace_entry_bytes(step_dir: Path, fqn: str, data: bytes) -> None:
    """Points the storage record of `fqn` (its first chunk's) at `data`, appended to its data file, in the metadata a
    load reads (metadata.json, or `.metadata` where there is none); the manifest is recomputed."""
    json_path = step_dir / METADATA_JSON
    if json_path.is_file():
        record = json.loads(json_path.read_text())
        item = next(item for item in record["storage_data"] if item["index"]["fqn"] == fqn)
        item["offset"], item["length"] = _append(step_dir / item["relative_path"], data), len(data)
        json_path.write_text(json.dumps(record))
    else:

        def point_at_data(metadata):
            info = next(info for index, info in metadata.storage_data.items() if index.fqn == fqn)
            info.offset, info.length = _append(step_dir / info.relative_path, data), len(data)

        replace_metadata(step_dir, point_at_data)
    rewrite_manifest(step_dir)


def _append(path: Path, data: bytes) -> int:
    """Appends `data` to `path`; returns where it starts."""
    start = path.stat().st_size
    with path.open("ab") as file:
        file.write(data)
    return start


def remove_file(step_dir: Path, name: str) -> None:
    """Removes `name` from `step_dir` and from its manifest (whose other records are kept as they are)."""
    (step_dir / name).unlink(missing_ok=True)
    if (step_dir / MANIFEST).is_file():
        manifest = json.loads((step_dir / MANIFEST).read_text())
        manifest["files"].pop(name, None)
        (step_dir / MANIFEST).write_text(json.dumps(manifest))


def legacy_checkpoint(step_dir: Path, entry: str, value: object) -> None:
    """`step_dir` rewritten as a checkpoint from before state.json (or another tool): its non-tensor values pickled
    into DCP's data file, `entry` holding `value`."""
    state = Loader(FileCheck(step_dir)).load_whole()
    values = json.loads((step_dir / VALUES).read_text()) if (step_dir / VALUES).is_file() else {}
    for name, held in (values | {entry: value}).items():
        component, key = name.split(".", 1)
        state.setdefault(component, {})[key] = held
    for path in step_dir.iterdir():
        path.unlink()
    with warnings.catch_warnings():  # DCP's note that it saves in one process, which is the intent
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(step_dir), no_dist=True)
    files = {path.name: manifest_record(path) for path in step_dir.iterdir()}
    (step_dir / MANIFEST).write_text(json.dumps({"files": files}))
