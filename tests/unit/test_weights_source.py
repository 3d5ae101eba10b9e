"""Where the weights come from is decided once, by preflight, as one of four kinds; the job draws weights only when
none is loaded, and the trainer loads what the kind names."""

from pathlib import Path

from torchpre.assembly.weights import DcpFolder, HfFolder, RandomInit, Resume, weights_source
from torchpre.config.job_config import Checkpoint


def no_hf(path: Path):
    raise AssertionError(f"{path} read as a Hugging Face folder")


def test_the_run_s_own_checkpoint_wins_over_an_initial_folder(tmp_path):
    settings = Checkpoint(enable=True, initial_load_path=str(tmp_path))
    source = weights_source(settings, tmp_path / "step-4", no_hf)
    assert source == Resume(tmp_path / "step-4") and source.loads_weights and source.folder == tmp_path / "step-4"


def test_a_resume_that_excludes_the_model_draws_the_weights_from_the_seed(tmp_path):
    settings = Checkpoint(enable=True, exclude_from_loading=["model", "optimizer"])
    source = weights_source(settings, tmp_path / "step-4", no_hf)
    assert source == Resume(tmp_path / "step-4", loads_weights=False) and source.folder is None


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
