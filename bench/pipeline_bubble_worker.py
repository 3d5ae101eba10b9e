"""One rank of the pipeline-bubble benchmark: trains with the real torchpre Trainer and times, per rank,
how much of each pipeline step is spent computing.

Launched by bench/pipeline_bubble.py as
`torchrun -m bench.pipeline_bubble_worker --out FILE --warmup K --steps N -- <train.py flags>`.
Nothing in torchpre changes: the compute entry points of torch.distributed.pipelining (a stage's
forward, backward and weight-backward of one microbatch, and the loss on the last stage) are wrapped
with timers, and the Trainer's pipeline forward/backward is bracketed by barriers, so that every rank
times the same window (the slowest rank's schedule step) and a rank's idle = 1 - busy / window.
"""

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineSchedule

from torchpre.config.job_config import JobConfig
from torchpre.config.parser import parse_args
from torchpre.distributed.process_groups import shutdown_distributed
from torchpre.training.trainer import Trainer


class BusyClock:
    """Seconds this process spent inside the wrapped compute calls since the last `reset`."""

    def __init__(self) -> None:
        self.busy = 0.0

    def reset(self) -> None:
        """Starts a new step's count."""
        self.busy = 0.0

    def wrap(self, method: Callable) -> Callable:
        """`method`, adding its wall time to `busy` (calls never nest, so nothing is counted twice)."""

        @functools.wraps(method)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.busy += time.perf_counter() - start

        return timed


def instrument(clock: BusyClock) -> None:
    """Times every call that computes: the stage's forward, full or input backward, weight backward, and
    the loss (which the schedule computes outside the stage's forward). P2P waits stay outside, so they
    count as idle, as a bubble does."""
    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        setattr(PipelineStage, name, clock.wrap(getattr(PipelineStage, name)))
    _PipelineSchedule._maybe_compute_loss = clock.wrap(_PipelineSchedule._maybe_compute_loss)


def time_pipeline_steps(trainer: Trainer, clock: BusyClock, warmup: int, steps: int) -> list[tuple[float, float]]:
    """(busy, window) seconds of this rank for each of `steps` training steps after `warmup` untimed ones.

    The window opens after a barrier and closes after another, so a rank that finishes its part early
    (the last stage in GPipe) waits for the rest and that wait counts as idle. The optimizer step runs
    outside the window: it is not part of the pipeline schedule the theory describes.
    """
    records: list[tuple[float, float]] = []
    model = trainer.job.model
    forward_backward = model.forward_backward

    def bracketed(microbatches, *args, **kwargs):
        dist.barrier()
        clock.reset()
        start = time.perf_counter()
        loss = forward_backward(microbatches, *args, **kwargs)
        dist.barrier()
        records.append((clock.busy, time.perf_counter() - start))
        return loss

    model.forward_backward = bracketed
    for _ in range(warmup + steps):
        trainer.train_step(trainer.job.data.next_step())
    return records[warmup:]


def main() -> None:
    """Trains, times, and has rank 0 write every rank's median idle, compute and window as JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="JSON file rank 0 writes the results to")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps (shape inference, allocator)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="train.py flags, after --")
    args = parser.parse_args()
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args

    clock = BusyClock()
    instrument(clock)
    trainer = Trainer(parse_args(JobConfig, train_args))
    records = time_pipeline_steps(trainer, clock, args.warmup, args.steps)
    idle = [1 - busy / window for busy, window in records]
    mine = {"idle": statistics.median(idle), "busy_s": statistics.median(b for b, _ in records),
            "window_s": statistics.median(w for _, w in records)}
    every_rank: list[dict] = [{}] * dist.get_world_size()
    dist.all_gather_object(every_rank, mine)
    if dist.get_rank() == 0:
        args.out.write_text(json.dumps(every_rank))
    shutdown_distributed()


if __name__ == "__main__":
    main()
