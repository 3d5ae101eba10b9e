"""Train a model: `python -m torchpre.train --job.config_file train_configs/X.toml [--section.key v ...]`.

On several processes: `torchrun --nproc_per_node=N -m torchpre.train ...` (or `torchrun ... train.py ...` from a
checkout: the root train.py is a shim for this module). Without torchrun it runs the same job as a single
process; `--help` lists every option. `job.custom_import` names a module to import before the job is checked,
e.g. one that registers a model family.
"""

import sys

from torchpre.config.job_config import JobConfig
from torchpre.config.parser import parse_args
from torchpre.runtime.cli import run_entry_point
from torchpre.runtime.custom_import import import_custom_module

PROG = "python -m torchpre.train"


def main(argv: list[str]) -> None:
    """Parses the job, imports `job.custom_import` (so what it registers exists), then checks the job and trains
    it, or with job.dry_run reports its per-rank memory (torchpre.planner.dryrun)."""
    config = parse_args(JobConfig, argv)
    from torchpre.training.trainer import Trainer  # torch loads here: `--help` and a mistyped flag answer without it

    import_custom_module(config.job.custom_import)
    if config.job.dry_run:
        from torchpre.planner.dryrun import run_dry_run

        run_dry_run(config)
        return
    Trainer(config).train()


if __name__ == "__main__":
    run_entry_point(main, sys.argv[1:], prog=PROG)
