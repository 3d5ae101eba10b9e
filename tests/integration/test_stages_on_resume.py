"""A resume compares the data stages with those the checkpoint saved as data (train.data_stages in its state.json),
never with its config.toml, which torchpre does not read back (issue 60): a checkpoint whose config.toml says other
stages (re-signed by its manifest) resumes without a word about them; a real change of the steps already taken is
warned about; a checkpoint saved before the stages were (no train.data_stages) resumes with an info line."""

import json
import shutil
from pathlib import Path

import pytest

from tests.launch import TINY, add_manifest, run_train
from torchpre.training.stages import SAVED_KEY

pytestmark = pytest.mark.slow

CKPT = ["--checkpoint.enable", "--checkpoint.interval", "2"]
PAST_CHANGED = "differ from those of the run that saved step 4, for steps it already took"


def stages_config(path: Path, extension_step: int) -> list[str]:
    """A config of two stages: the job's data at seq_len 32, then at 64 from `extension_step`."""
    second = f"[[training.data_stages]]\nstart_step = {extension_step}\nseq_len = 64\n"
    path.write_text(f"[[training.data_stages]]\n{second}")
    return ["--job.config_file", str(path)]


def resume(folder: Path, args: list[str]) -> str:
    result = run_train([*args, "--training.steps", "6"], 1, folder)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout + result.stderr


def test_a_resume_compares_the_stages_saved_as_data_not_the_checkpoints_config_toml(tmp_path):
    saved = [*TINY, *CKPT, *stages_config(tmp_path / "saved.toml", 3)]
    other = [*TINY, *CKPT, *stages_config(tmp_path / "other.toml", 1)]  # stage 2 from step 1: another past
    genuine = tmp_path / "genuine"
    result = run_train([*saved, "--training.steps", "4"], 1, genuine)
    assert result.returncode == 0, result.stderr[-3000:]
    step = genuine / "checkpoint" / "step-4"
    assert json.loads((step / "state.json").read_text())[SAVED_KEY] == [
        {"name": "stage-1", "start_step": 0, "seq_len": 32, "mixture": {}},
        {"name": "stage-2", "start_step": 3, "seq_len": 64, "mixture": {}},
    ]

    altered = shutil.copytree(genuine, tmp_path / "altered")  # its config.toml says the other stages
    (altered / "checkpoint" / "step-4" / "config.toml").write_text((genuine / "config.toml").read_text().replace(
        "start_step = 3", "start_step = 1"))  # fmt: skip
    add_manifest(altered / "checkpoint" / "step-4")
    log = resume(altered, saved)
    assert "loaded" in log and PAST_CHANGED not in log and "records no data stages" not in log

    changed = shutil.copytree(genuine, tmp_path / "changed")
    assert PAST_CHANGED in resume(changed, other)

    old = shutil.copytree(genuine, tmp_path / "old")  # as saved before the stages were
    state = old / "checkpoint" / "step-4" / "state.json"
    values = json.loads(state.read_text())
    del values[SAVED_KEY]
    state.write_text(json.dumps(values))
    add_manifest(old / "checkpoint" / "step-4")
    log = resume(old, other)
    assert f"{old / 'checkpoint' / 'step-4'} records no data stages (it was saved before they were)" in log
    assert PAST_CHANGED not in log
