"""train.py that, once the job has loaded checkpoint.initial_load_path (a Hugging Face folder), writes what it
loaded: every rank's model state gathered to whole tensors ({dump_folder}/state_rank{R}.safetensors) and its load
report (load_rank{R}.json: bytes held and read, RSS before and at the peak); then it trains as train.py would.

Run like train.py (`torchrun ... tests/hf_import_worker.py --section.key value ...`).
"""

import dataclasses
import json
import sys
from pathlib import Path

import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchpre.runtime.cli import run_entry_point  # noqa: E402


def main(argv: list[str]) -> None:
    from torchpre.config.job_config import JobConfig
    from torchpre.config.parser import parse_args
    from torchpre.training.trainer import Trainer

    config = parse_args(JobConfig, argv)
    trainer = Trainer(config)
    folder, rank = Path(config.job.dump_folder), dist.get_rank()
    state = {}
    for part in trainer.job.model.parts:
        for name, value in part.state_dict().items():  # the same names in the same order on a stage's ranks
            whole = value.full_tensor() if isinstance(value, DTensor) else value
            state[name] = whole.detach().clone().contiguous()
    save_file(state, folder / f"state_rank{rank}.safetensors")
    report = dataclasses.asdict(trainer.hf_load_report) | {"bound": trainer.hf_load_report.bound}
    (folder / f"load_rank{rank}.json").write_text(json.dumps(report))
    trainer.train()


if __name__ == "__main__":
    run_entry_point(main, sys.argv[1:], prog="tests/hf_import_worker.py")
