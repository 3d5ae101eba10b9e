"""Resumes a checkpoint under another layout, checks the state round trip, then trains on.

Run like train.py (`torchrun ... tests/reshard_worker.py --section.key value ...`). When the job resumes from a
checkpoint, every rank runs `check_round_trip` right after loading and rank 0 writes its report to
{dump_folder}/roundtrip.json; then training continues as train.py's would. The GPT-2-style test model is
registered as `model.name = "gpt2-test"`, and Llama 3 at the tiny flavor's sizes with the 4 blocks the V
schedule's 4 stages need as `model.name = "llama3-matrix"` (flavors `tiny4` and `tiny4_tied`).
"""

import dataclasses
import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.gpt2_model import NAME, SPEC  # noqa: E402
from torchpre.models.llama3.args import LLAMA3_FLAVORS  # noqa: E402
from torchpre.models.llama3.spec import SPEC as LLAMA3_SPEC  # noqa: E402
from torchpre.models.registry import register_model  # noqa: E402
from torchpre.runtime.cli import run_entry_point  # noqa: E402

REPORT = "roundtrip.json"
LLAMA_NAME = "llama3-matrix"
_TINY4 = dataclasses.replace(LLAMA3_FLAVORS["tiny"], n_layers=4)
LLAMA_SPEC = dataclasses.replace(
    LLAMA3_SPEC, flavors={"tiny4": _TINY4, "tiny4_tied": dataclasses.replace(_TINY4, tie_word_embeddings=True)}
)


def main(argv: list[str]) -> None:
    from torchpre.checkpoint.roundtrip import check_round_trip
    from torchpre.config.job_config import JobConfig
    from torchpre.config.parser import parse_args
    from torchpre.training.trainer import Trainer

    register_model(NAME, SPEC)
    register_model(LLAMA_NAME, LLAMA_SPEC)
    config = parse_args(JobConfig, argv)
    trainer = Trainer(config)
    if trainer.last_checkpoint_step is not None:
        step_dir = trainer.job.checkpoint.folder / f"step-{trainer.last_checkpoint_step}"
        report = check_round_trip(trainer.job.checkpoint, step_dir)
        if dist.get_rank() == 0:
            summary = {**dataclasses.asdict(report), "ok": report.ok, "text": str(report)}
            (Path(config.job.dump_folder) / REPORT).write_text(json.dumps(summary, indent=1), encoding="utf-8")
    trainer.train()


if __name__ == "__main__":
    run_entry_point(main, sys.argv[1:], prog="tests/reshard_worker.py")
