"""Hostile files built from genuine ones, for the tests of the trust boundary (docs/security.md): each payload only
appends a line to a marker file, so a test passes when the marker stays absent."""

import json
import pickle
import warnings
from pathlib import Path

import torch.distributed.checkpoint as dcp

from tests.launch import manifest_record
from torchpre.checkpoint.integrity import MANIFEST, FileCheck
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
    """Rewrites `.metadata` (plain pickle, as an attacker would) after `edit(metadata)`."""
    path = step_dir / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    edit(metadata)
    path.write_bytes(pickle.dumps(metadata))


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
