"""Where a job's weights come from, decided once by preflight (`find_resume`, `weights_source`) and read by the job
(whether to draw initial weights), the trainer (what to load) and generate (which checkpoint to decode from)."""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torchpre.checkpoint.folders import find_step_dir
from torchpre.checkpoint.integrity import LATEST, Trust, check_verifiable, find_intact_step
from torchpre.config.job_config import Checkpoint
from torchpre.interchange.load import HFWeights
from torchpre.interchange.reader import is_hf_folder


@dataclass(frozen=True)
class RandomInit:
    """Drawn from training.seed (`ModelSpec.init_weights`): no checkpoint holds them."""

    loads_weights = False
    folder = None


@dataclass(frozen=True)
class Resume:
    """The run's own checkpoint, found by preflight (`find_resume`): `step_dir`, the newest complete step (`latest`)
    or checkpoint.load_step's, whose entries load except those checkpoint.exclude_from_loading names. A resume that
    excludes the "model" entry (`loads_weights` False) draws its weights from the seed. Its files are checked whole
    when it loads (`CheckpointManager.resume_step`), where the ranks share the reads."""

    step_dir: Path
    latest: bool = True
    loads_weights: bool = True

    @property
    def step(self) -> int:
        return int(self.step_dir.name.removeprefix("step-"))

    @property
    def folder(self) -> Path | None:
        return self.step_dir if self.loads_weights else None


@dataclass(frozen=True)
class DcpFolder:
    """checkpoint.initial_load_path as a checkpoint step folder (or a hf-to-dcp output): its "model" entry starts a
    new run."""

    folder: Path
    loads_weights = True


@dataclass(frozen=True)
class HfFolder:
    """checkpoint.initial_load_path as a Hugging Face folder, checked against the model: its weights start a new
    run."""

    folder: Path
    weights: HFWeights
    loads_weights = True


WeightsSource = RandomInit | Resume | DcpFolder | HfFolder


def find_resume(checkpoint: Checkpoint, folder: Path, trust: Trust) -> Resume | None:
    """The checkpoint in the run's checkpoint `folder` that the job resumes from, found once, before the process group,
    from the folder's listing: the newest complete step (checkpoint.load_step = -1) or the one load_step names, with a
    manifest `trust` accepts (`check_verifiable`); None for a fresh run (checkpoint.enable off, or no complete step).
    A folder that holds only step-N links is refused by name, never taken for a fresh run. Its files are read later,
    by the load, where every rank checks a share of them."""
    if not checkpoint.enable:
        return None
    step_dir = find_step_dir(folder, checkpoint.load_step)
    if step_dir is None:
        find_intact_step(folder, checkpoint.load_step, trust)  # only step-N links, if anything: each named
        return None
    key = LATEST if checkpoint.load_step == -1 else f"checkpoint.load_step = {checkpoint.load_step}"
    check_verifiable(step_dir, key, trust)
    loads_weights = "model" not in checkpoint.exclude_from_loading
    return Resume(step_dir, latest=checkpoint.load_step == -1, loads_weights=loads_weights)


def weights_source(
    checkpoint: Checkpoint, resume: Resume | None, hf_weights: Callable[[Path], HFWeights]
) -> WeightsSource:
    """The run's own checkpoint `resume` if there is one, else checkpoint.initial_load_path (`hf_weights` reads and
    checks a Hugging Face folder's), else the seed."""
    if resume is not None:
        return resume
    if not checkpoint.initial_load_path:
        return RandomInit()
    path = Path(checkpoint.initial_load_path)
    return HfFolder(path, hf_weights(path)) if is_hf_folder(path) else DcpFolder(path)
