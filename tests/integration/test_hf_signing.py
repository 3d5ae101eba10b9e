"""A Hugging Face folder under checkpoint.signing_key_file (docs/security.md): torchpre's exports are signed, and a
load under the key refuses a folder that is unsigned (unless checkpoint.allow_unsigned_hf, for a model as released),
signed with another key, or altered, through both ways weights come in (checkpoint.initial_load_path, hf-to-dcp)."""

import json
import shutil
from pathlib import Path

import pytest

from tests.launch import TINY, run_entry, run_train
from torchpre.checkpoint.integrity import MANIFEST

pytestmark = pytest.mark.slow

EXIT_BAD_INPUT = 2
KEY, OTHER_KEY = "0123456789abcdef0123456789abcdef", "fedcba9876543210fedcba9876543210"


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """A run signed under KEY, its step-2 exported by `convert dcp-to-hf` under the key (signed), and unsigned."""
    root = tmp_path_factory.mktemp("signed")
    (root / "key").write_text(KEY)
    (root / "other_key").write_text(OTHER_KEY)
    signed = ["--checkpoint.signing_key_file", str(root / "key")]
    args = [*TINY, "--training.steps", "2", "--checkpoint.enable", "--checkpoint.interval", "2", *signed]
    assert run_train(args, 1, root / "run").returncode == 0
    step = str(root / "run" / "checkpoint" / "step-2")
    for name, extra in (("signed_hf", signed), ("unsigned_hf", [])):
        convert = ["dcp-to-hf", step, str(root / name), "--model.flavor", "tiny", "--max_shard_size", "300KB", *extra]
        result = run_entry("torchpre.convert", convert)
        assert result.returncode == 0, result.stderr[-3000:]
    return root


def _alter_a_weight(folder: Path) -> None:
    weights = sorted(folder.glob("*.safetensors"))[-1]
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))


CASES = {  # folder, key, extra flags, how it is changed -> what a load says (None: it loads)
    "signed": ("signed_hf", "key", [], None, None),
    "unsigned": ("unsigned_hf", "key", [], None, "has no manifest.json, so it is not signed"),
    "unsigned, allowed": ("unsigned_hf", "key", ["--checkpoint.allow_unsigned_hf"], None, None),
    "another key": ("signed_hf", "other_key", [], None, "its signature does not match this key"),
    "a weight altered": ("signed_hf", "key", [], _alter_a_weight, "fails its SHA-256 check"),
    "a file unlisted": ("signed_hf", "key", [], lambda folder: shutil.copy(
        next(folder.glob("*.safetensors")), folder / "model-00009-of-00009.safetensors"), "is not in its manifest"),
}  # fmt: skip


@pytest.mark.parametrize("load_path", ["initial_load_path", "hf-to-dcp"])
@pytest.mark.parametrize("case", CASES)
def test_a_hugging_face_folder_loads_under_a_key_only_as_signed(exported, tmp_path, case, load_path):
    name, key, extra, change, refusal = CASES[case]
    folder = shutil.copytree(exported / name, tmp_path / name)
    if change is not None:
        change(folder)
    keyed = ["--checkpoint.signing_key_file", str(exported / key), *extra]
    if load_path == "initial_load_path":
        args = [*TINY, "--training.steps", "1", "--checkpoint.initial_load_path", str(folder), *keyed]
        result = run_train(args, 1, tmp_path / "run")
    else:
        argv = ["hf-to-dcp", str(folder), str(tmp_path / "step-0"), "--model.flavor", "tiny", *keyed]
        result = run_entry("torchpre.convert", argv)
    if refusal is None:
        assert result.returncode == 0, result.stderr[-3000:]
        unsigned_warning = "loading an unsigned Hugging Face folder (checkpoint.allow_unsigned_hf = true)"
        assert (unsigned_warning in result.stdout + result.stderr) == ("allowed" in case)
        return
    assert result.returncode == EXIT_BAD_INPUT, result.stderr[-3000:]
    assert refusal in result.stderr and str(folder) in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists() and not (tmp_path / "step-0").exists()


def test_an_export_under_a_key_is_signed_for_every_file_it_holds(exported):
    manifest = json.loads((exported / "signed_hf" / MANIFEST).read_text())
    files = {path.name for path in (exported / "signed_hf").iterdir()} - {MANIFEST}
    assert set(manifest["files"]) == files and len(manifest["signature"]) == 64
    assert not (exported / "unsigned_hf" / MANIFEST).exists()
