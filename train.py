"""Train a model: `torchrun --nproc_per_node=N train.py --job.config_file train_configs/X.toml [--section.key v ...]`.

A shim for `python -m torchpre.train` (see there), kept so that `torchrun train.py ...` and `python train.py ...`
work from a checkout; `python train.py ...` runs the same job as a single process, `--help` lists every option.
"""

import sys

from torchpre.runtime.cli import run_entry_point
from torchpre.train import main

if __name__ == "__main__":
    run_entry_point(main, sys.argv[1:], prog="train.py")
