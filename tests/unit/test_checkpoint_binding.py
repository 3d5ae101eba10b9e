"""What a signature binds besides the files (docs/security.md): the step a checkpoint was saved as and the run that
saved it. A signed checkpoint under another step's name, or copied in from another run, is refused; the values of
`state.json` are typed and ranged before anything uses them; a file the manifest does not list is never read, and a
`step-N` that is a symbolic link is never loaded."""

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.hostile import rewrite_manifest
from tests.unit.test_checkpoint_integrity import _components, _loaded_step, _manager, _save
from tests.unit.test_checkpoint_trust import _signing
from torchpre.checkpoint.integrity import MANIFEST, FileCheck
from torchpre.checkpoint.run import RUN_FILE
from torchpre.checkpoint.values import RULES, VALUES, read_values, rule_of
from torchpre.errors import TorchpreError, UntrustedInput


@pytest.fixture
def key(tmp_path) -> Path:
    (tmp_path / "key").write_text("0123456789abcdef0123456789abcdef\n")
    return tmp_path / "key"


def _signed_run(folder: Path, key: Path, *steps: int):
    signer = _signing(folder, key)
    for step in steps:
        signer.components["train"].values["step"] = step
        signer.save(step)
    return signer


def test_a_signed_manifest_records_the_step_and_the_run_of_its_folder(world, tmp_path, key):
    _signed_run(tmp_path / "run", key, 2)
    manifest = json.loads((tmp_path / "run" / "step-2" / MANIFEST).read_text())
    run = json.loads((tmp_path / "run" / RUN_FILE).read_text())
    assert manifest["step"] == 2 and manifest["run"] == run["run"] and len(run["signature"]) == 64
    assert _loaded_step(_signing(tmp_path / "run", key), tmp_path / "run" / "step-2") == 2


def test_a_signed_step_copied_under_another_steps_name_is_refused(world, tmp_path, key, caplog):
    """The reviewer's replay: step-2 copied as step-4 made the run train steps 3-4 again without a word."""
    folder = tmp_path / "run"
    _signed_run(folder, key, 2)
    shutil.copytree(folder / "step-2", folder / "step-4")
    with pytest.raises(TorchpreError, match="it was signed as step 2, but lies in step-4: it was copied or renamed"):
        _signing(folder, key).find(4)
    assert _signing(folder, key).find(-1) == folder / "step-2"  # the latest is skipped, named, and moved aside
    assert "it was signed as step 2, but lies in step-4" in caplog.text and (folder / "damaged-step-4").is_dir()


@pytest.mark.parametrize("how", ["copied in", "run.json removed", "run.json replaced unsigned"])
def test_a_signed_checkpoint_of_another_run_is_refused_on_resume(world, tmp_path, key, how):
    """Run B's signed step-6, copied into run A's folder: A's resume must not take it as its own."""
    a, b = tmp_path / "a", tmp_path / "b"
    _signed_run(a, key, 2)
    _signed_run(b, key, 6)
    if how == "copied in":
        shutil.copytree(b / "step-6", a / "step-6")
        expected = "not by this folder's run"
    elif how == "run.json removed":
        (a / RUN_FILE).unlink()
        expected = "its folder has no run.json"
    else:
        (a / RUN_FILE).write_text(json.dumps({"run": json.loads((b / RUN_FILE).read_text())["run"]}))
        expected = "run.json: it is not signed"
    with pytest.raises(TorchpreError, match=expected):
        _signing(a, key).find(6 if how == "copied in" else 2)
    weights = _signing(tmp_path / "c", key)  # another run's weights as a new run's start: allowed by name
    assert weights.load(b / "step-6", weights_only=True) == ["model"]


def test_a_step_folder_that_is_a_link_is_never_loaded(world, tmp_path, caplog):
    _save(tmp_path / "other", 8)
    _save(tmp_path / "run", 2)
    os.symlink(tmp_path / "other" / "step-8", tmp_path / "run" / "step-8")
    with pytest.raises(UntrustedInput, match="step-8 is a symbolic link, which may lead to another run's checkpoint"):
        _manager(tmp_path / "run").find(8)
    assert _manager(tmp_path / "run").find(-1) == tmp_path / "run" / "step-2"
    link = tmp_path / "run" / "step-8"
    assert f"{link} is a symbolic link, which may lead to another run's checkpoint" in caplog.text
    assert (tmp_path / "run" / "damaged-step-8").is_symlink(), "moved aside, as a damaged checkpoint is"


def test_a_lone_step_folder_that_is_a_link_stops_a_resume_of_the_latest(world, tmp_path):
    """No checkpoint but a link: the search for the latest refuses it rather than starting afresh."""
    _save(tmp_path / "other", 8)
    (tmp_path / "run").mkdir()
    os.symlink(tmp_path / "other" / "step-8", tmp_path / "run" / "step-8")
    with pytest.raises(TorchpreError, match="Every checkpoint in .* is corrupt: .*step-8 is a symbolic link"):
        _manager(tmp_path / "run").find(-1)


def test_a_job_without_the_key_loads_a_signed_checkpoint(world, tmp_path, key):
    """The signature proves authorship to whoever holds the key; the CRC-32 check runs for everyone."""
    _signed_run(tmp_path / "run", key, 2)
    assert _loaded_step(_manager(tmp_path / "run"), tmp_path / "run" / "step-2") == 2


def test_a_file_the_manifest_does_not_list_is_never_read(world, tmp_path):
    """The whole folder's check vouches only for the files its manifest lists."""
    _save(tmp_path, 2)
    step_dir = tmp_path / "step-2"
    (step_dir / "extra.distcp").write_bytes(b"x" * 64)
    check = FileCheck(step_dir).whole_folder_checked()
    check.require("__0_0.distcp")
    with pytest.raises(TorchpreError, match="extra.distcp is not in its manifest.json"):
        check.require("extra.distcp")
    with pytest.raises(TorchpreError, match="extra.distcp is not in its manifest.json"):
        check.read("extra.distcp", 100)


def test_a_small_file_is_parsed_only_as_the_bytes_its_digest_vouches_for(world, tmp_path):
    """state.json altered to another valid step of the same length, the manifest left as saved: refused as read, from
    the very bytes that would be parsed (one open, one read)."""
    _save(tmp_path, 2)
    step_dir = tmp_path / "step-2"
    (step_dir / VALUES).write_text((step_dir / VALUES).read_text().replace('"train.step": 2', '"train.step": 3'))
    with pytest.raises(TorchpreError, match=f"{step_dir / VALUES} fails its CRC-32 check"):
        read_values(FileCheck(step_dir))


class _Refusing:
    """A component that refuses values which are each fine but do not fit together (as the data sampler refuses a
    position off the batch grid)."""

    def state_dict(self) -> dict[str, int]:
        return {"position": 0}

    def load_state_dict(self, state: dict[str, int]) -> None:
        raise ValueError(f"position {state['position']} is off the grid")


def test_values_a_component_refuses_together_are_bad_input_naming_the_checkpoint(world, tmp_path):
    """Found by the fuzzer: consumed_samples 8 -> 9 passed its range check, then the sampler's ValueError ended the
    resume in a traceback."""
    _manager(tmp_path, components=_components(step=2) | {"refusing": _Refusing()}).save(2)
    with pytest.raises(UntrustedInput, match=r"step-2: the entry 'refusing' cannot be loaded \(position 0 is off"):
        _manager(tmp_path, components=_components() | {"refusing": _Refusing()}).load(tmp_path / "step-2")


# One bad value for each rule of state.json, with what the message says it should be.
BAD_VALUES = {
    "train.step": [-54, 2.0, "2", None, 3],
    "train.global_batch_size": [-2, 0, 1.5, True],
    "train.dp": [0, -1],
    "train.seq_len": [0],
    "dataloader.consumed_samples": [-16, float("nan"), 2**63],
    "dataloader.order_version": [0, -1, 1.5, "2"],
    "health.skipped_steps": [-1, "x"],
    "train.rope_theta": [float("nan"), float("inf"), -1.0, "500000"],
    "lr_scheduler.last_epoch": [-1, 1.0],
    "lr_scheduler.base_lrs": [[float("nan")], [-0.1], 0.1, [[0.1]]],
    "lr_scheduler._is_initial": [0, "false"],
    "lr_scheduler.lr_lambdas": [["exec"], [0]],
    "train.data_stages": ["x", [1], {"a": 1}],
}


def test_every_rule_of_state_json_has_bad_values_here():
    assert {rule for name in BAD_VALUES for rule in [rule_of(name)]} >= set(RULES.values())


@pytest.mark.parametrize("name, value", [(n, v) for n, values in BAD_VALUES.items() for v in values])
def test_a_state_value_out_of_its_type_or_range_is_refused_naming_it(world, tmp_path, name, value):
    _save(tmp_path, 2)
    step_dir = tmp_path / "step-2"
    values = json.loads((step_dir / VALUES).read_text())
    values[name] = value
    (step_dir / VALUES).write_text(json.dumps(values))
    rewrite_manifest(step_dir)
    with pytest.raises(UntrustedInput) as error:
        read_values(FileCheck(step_dir))
    assert f"{step_dir / VALUES}: {name!r} is" in str(error.value)


@pytest.mark.parametrize("value", [[0.1, 0.1], [], {"a": 1}])
def test_a_state_list_must_have_the_live_values_length(world, tmp_path, value):
    """A shorter base_lrs would leave a parameter group's learning rate as it was (zip stops early)."""
    _save(tmp_path, 2)
    step_dir = tmp_path / "step-2"
    values = json.loads((step_dir / VALUES).read_text())
    values["lr_scheduler.base_lrs"] = value
    (step_dir / VALUES).write_text(json.dumps(values))
    rewrite_manifest(step_dir)
    with pytest.raises(TorchpreError, match=r"'lr_scheduler.base_lrs' is .*, not (a list of 1 items|a list of finite)"):
        _manager(tmp_path, components=_components()).load(step_dir)
