"""train.py, counting the host syncs (tests/host_syncs.py) of one whole training step: the last but one.

Run like train.py with metrics.log_freq above training.steps, so that the step measured is not a log step, and
training.steps >= 3, so that it is not the first (start-up: pipeline shape inference, lazy state). Every rank
writes {dump_folder}/host_syncs_rank{R}.json: the list of syncs, each `{"what", "site", "stack"}`.

The span measured runs from the fetch of that step's first microbatch to the fetch of the next step's: the loop's
bookkeeping after the step counts, the fetches themselves do not (host-side data, no device work to wait for).
"""

import contextlib
import dataclasses
import itertools
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.host_syncs import HostSyncCounter  # noqa: E402
from torchpre.runtime.cli import run_entry_point  # noqa: E402


class _MeasuredLoader:
    """The trainer's data loader, counting host syncs from the fetch of step `step`'s first microbatch to the fetch
    of the next step's; anything else is the loader's."""

    def __init__(self, loader, counter: HostSyncCounter, step: int, microbatches_per_step: int) -> None:
        self._loader, self._counter = loader, counter
        self._start = (step - 1) * microbatches_per_step  # batches fetched before the measured step's first
        self._stop = self._start + microbatches_per_step

    def __getattr__(self, name: str):
        return getattr(self._loader, name)

    def __iter__(self) -> Iterator:
        batches, span = iter(self._loader), contextlib.ExitStack()
        with span:
            for fetched in itertools.count():
                with self._counter.pause():
                    batch = next(batches, None)
                if fetched == self._stop:
                    span.close()
                if fetched == self._start:
                    span.enter_context(self._counter.counting())
                if batch is None:
                    return
                yield batch


def host_step_counts(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """The optimizer's per-parameter step counts that torch keeps in host memory on any device (all but those of
    capturable or fused param groups): `_get_value(step)` reads them with `.item()` each step, waiting for no GPU."""
    for group in optimizer.param_groups:
        if group.get("capturable") or group.get("fused"):
            continue
        for param in group["params"]:
            step = optimizer.state.get(param, {}).get("step")
            if isinstance(step, torch.Tensor):
                yield step


def main(argv: list[str]) -> None:
    from torchpre.config.job_config import JobConfig
    from torchpre.config.parser import parse_args
    from torchpre.training.trainer import Trainer

    config = parse_args(JobConfig, argv)
    steps = config.training.steps
    assert steps >= 3 and config.metrics.log_freq > steps, "measure a non-log step after the first"
    trainer = Trainer(config)
    job = trainer.job
    counter = HostSyncCounter(host_resident=lambda: host_step_counts(job.optimizer.inner))
    job.data.loader = _MeasuredLoader(job.data.loader, counter, steps - 1, job.batches.accumulation_steps)
    trainer.train()
    syncs = [dataclasses.asdict(sync) for sync in counter.syncs]
    out = Path(config.job.dump_folder) / f"host_syncs_rank{dist.get_rank()}.json"
    out.write_text(json.dumps(syncs, indent=1))


if __name__ == "__main__":
    run_entry_point(main, sys.argv[1:], prog="tests/count_host_syncs.py")
