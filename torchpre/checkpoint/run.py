"""Which run a checkpoint folder's checkpoints belong to: `run.json` in the folder names the run (a random id made by
the first job that saved there), and every manifest saved there records it. Under checkpoint.signing_key_file both
are signed, so a signed checkpoint of another run copied into this folder is refused on resume instead of being
loaded as this run's (docs/security.md). A job resumed in the folder continues its run and keeps the id.

`run.json` is {"run": id} and, under a key, "signature": HMAC-SHA256 of "run:" + id.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import secrets
from pathlib import Path

from torchpre.checkpoint.integrity import Trust
from torchpre.confined import file_kind, write_file
from torchpre.errors import FieldError, UntrustedInput, json_field
from torchpre.json_input import read_json

RUN_FILE = "run.json"
SIGNING_KEY = "checkpoint.signing_key_file"


def read_run(folder: Path, signing_key: bytes | None) -> str | None:
    """The run id `folder/run.json` names; None when there is none. Under `signing_key` it must be signed with it."""
    if file_kind(folder, RUN_FILE) == "missing":
        return None
    path = folder / RUN_FILE
    record = read_json(folder, RUN_FILE, "manifest")
    try:
        run = json_field(record, "run", str)
        signature = json_field(record, "signature", str, default=None)
    except FieldError as error:
        raise UntrustedInput(f"{path} is not a valid run record ({error}).") from None
    if not run or len(run) > 64:
        raise UntrustedInput(f"{path}: 'run' is {run!r}, not a run id.")
    if signing_key is not None and (signature is None or not hmac.compare_digest(signature, _sign(run, signing_key))):
        why = "it is not signed" if signature is None else "its signature does not match this key"
        raise UntrustedInput(
            f"{path}: {why}, and {SIGNING_KEY} asks for checkpoints signed with its key. It names the run this "
            "folder's checkpoints belong to: restore the file the run wrote, or point checkpoint.folder elsewhere "
            "(docs/security.md)."
        )
    return run


def resume_trust(folder: Path, trust: Trust) -> Trust:
    """`trust` for a resume from `folder`: under a signing key, its checkpoints must be the run's that `run.json`
    names (none at all when the folder has no run.json: "" is no run's id)."""
    if trust.signing_key is None:
        return trust
    return dataclasses.replace(trust, run=read_run(folder, trust.signing_key) or "")


def ensure_run(folder: Path, signing_key: bytes | None) -> str:
    """The run id of `folder` (created, with its folder, when there is none yet: a new run). Rank 0's call."""
    run = read_run(folder, signing_key)
    if run is not None:
        return run
    run = secrets.token_hex(16)
    record = {"run": run} | ({"signature": _sign(run, signing_key)} if signing_key is not None else {})
    folder.mkdir(parents=True, exist_ok=True)
    write_file(folder / RUN_FILE, json.dumps(record) + "\n", durable=True)
    return run


def _sign(run: str, key: bytes) -> str:
    return hmac.new(key, f"run:{run}".encode(), hashlib.sha256).hexdigest()
