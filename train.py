"""Train a model: `torchrun --nproc_per_node=N train.py --job.config_file train_configs/X.toml [--section.key v ...]`.

`python train.py ...` runs the same job as a single process; `--help` lists every option.
"""

import sys

from torchpre.cli import run_entry_point


def main(argv: list[str]) -> None:
    from torchpre.config.job_config import JobConfig
    from torchpre.config.parser import parse_args
    from torchpre.custom_import import import_custom_module
    from torchpre.trainer import Trainer

    config = parse_args(JobConfig, argv)
    import_custom_module(config.job.custom_import)
    trainer = Trainer(config)
    trainer.train()


if __name__ == "__main__":
    run_entry_point(main, sys.argv[1:], prog="train.py")
