"""Where a job's weights come from, decided once by preflight (`weights_source`) and read by the job (whether to
draw initial weights), the trainer (what to load) and generate (which checkpoint to decode from)."""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

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
    """The run's own checkpoint: `step_dir`, the newest complete step (or checkpoint.load_step's) found before the
    process group, whose entries load except those checkpoint.exclude_from_loading names. A resume that excludes the
    "model" entry (`loads_weights` False) draws its weights from the seed."""

    step_dir: Path
    loads_weights: bool = True

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


def weights_source(
    checkpoint: Checkpoint, resume_dir: Path | None, hf_weights: Callable[[Path], HFWeights]
) -> WeightsSource:
    """The run's checkpoint `resume_dir` if there is one, else checkpoint.initial_load_path (`hf_weights` reads and
    checks a Hugging Face folder's), else the seed."""
    if resume_dir is not None:
        return Resume(resume_dir, loads_weights="model" not in checkpoint.exclude_from_loading)
    if not checkpoint.initial_load_path:
        return RandomInit()
    path = Path(checkpoint.initial_load_path)
    return HfFolder(path, hf_weights(path)) if is_hf_folder(path) else DcpFolder(path)
