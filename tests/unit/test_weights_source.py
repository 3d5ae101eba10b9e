"""Where the weights come from is decided once, by preflight, as one of four kinds; the job draws weights only when
none is loaded, and the trainer loads what the kind names. A resume's step is found from the folder's listing before
the process group (`find_resume`); reading its files waits for the load."""

from pathlib import Path

import pytest

from torchpre.assembly.weights import DcpFolder, HfFolder, RandomInit, Resume, find_resume, weights_source
from torchpre.checkpoint.integrity import MANIFEST, Trust
from torchpre.config.job_config import Checkpoint
from torchpre.errors import TorchpreError


def no_hf(path: Path):
    raise AssertionError(f"{path} read as a Hugging Face folder")


def steps(folder: Path, *numbers: int) -> Path:
    """`folder` holding a `step-N` with a manifest for each of `numbers` (what the listing sees; no file is read)."""
    for number in numbers:
        (folder / f"step-{number}").mkdir(parents=True)
        (folder / f"step-{number}" / MANIFEST).write_text("{}")
    return folder


def test_preflight_finds_the_newest_complete_step_or_the_chosen_one(tmp_path):
    folder = steps(tmp_path / "checkpoint", 2, 4)
    latest = find_resume(Checkpoint(enable=True), folder, Trust())
    assert latest == Resume(folder / "step-4", latest=True) and latest.step == 4
    chosen = find_resume(Checkpoint(enable=True, load_step=2), folder, Trust())
    assert chosen == Resume(folder / "step-2", latest=False) and chosen.step == 2
    assert find_resume(Checkpoint(enable=False), folder, Trust()) is None
    assert find_resume(Checkpoint(enable=True), tmp_path / "empty", Trust()) is None


def test_a_resume_that_excludes_the_model_draws_the_weights_from_the_seed(tmp_path):
    folder = steps(tmp_path, 4)
    settings = Checkpoint(enable=True, exclude_from_loading=["model", "optimizer"])
    source = weights_source(settings, find_resume(settings, folder, Trust()), no_hf)
    assert source == Resume(folder / "step-4", loads_weights=False) and source.folder is None


def test_a_folder_of_step_links_only_is_refused_by_name_never_a_fresh_run(tmp_path):
    elsewhere = steps(tmp_path / "elsewhere", 6)
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "step-6").symlink_to(elsewhere / "step-6")
    with pytest.raises(TorchpreError, match="Every checkpoint in .* is corrupt: .*step-6 is a symbolic link"):
        find_resume(Checkpoint(enable=True), tmp_path / "checkpoint", Trust())


def test_a_step_without_a_manifest_is_refused_before_any_work(tmp_path):
    (tmp_path / "step-4").mkdir()
    (tmp_path / "step-4" / ".metadata").write_bytes(b"")
    with pytest.raises(TorchpreError, match="checkpoint.load_step = 4: the checkpoint .*step-4 has no manifest.json"):
        find_resume(Checkpoint(enable=True, load_step=4), tmp_path, Trust())
    assert find_resume(Checkpoint(enable=True, load_step=4), tmp_path, Trust(allow_unverified=True)) == Resume(
        tmp_path / "step-4", latest=False
    )


def test_the_run_s_own_checkpoint_wins_over_an_initial_folder(tmp_path):
    settings = Checkpoint(enable=True, initial_load_path=str(tmp_path))
    source = weights_source(settings, Resume(tmp_path / "step-4"), no_hf)
    assert source == Resume(tmp_path / "step-4") and source.loads_weights and source.folder == tmp_path / "step-4"


def test_without_a_checkpoint_the_initial_folder_is_a_checkpoint_or_a_hugging_face_folder(tmp_path):
    assert weights_source(Checkpoint(), None, no_hf) == RandomInit()
    assert not RandomInit().loads_weights
    step_dir = tmp_path / "step-2"
    step_dir.mkdir()
    assert weights_source(Checkpoint(initial_load_path=str(step_dir)), None, no_hf) == DcpFolder(step_dir)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    source = weights_source(Checkpoint(initial_load_path=str(hf)), None, lambda path: ("checked", path))
    assert source == HfFolder(hf, ("checked", hf)) and source.loads_weights and source.folder == hf
