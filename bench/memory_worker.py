"""train.py with exact tensor-memory accounting per step, for bench/memory.py.

Builds the real Trainer from the same arguments as train.py and trains it under
`torchpre.planner.tensor_memory.TensorMemory`, a TorchDispatchMode entered before the Trainer is
built: every storage an op creates is counted at its size until its last reference dies, so the
running total is every tensor byte of the job (parameters, buffers, optimizer state, gradients,
activations, temporaries) and its maximum is the CPU counterpart of CUDA's `max_memory_allocated`
(the module says why not the profiler, and what it cannot see). Peak RSS, which torchpre reports on
CPU, adds the Python/torch baseline and what the C allocator keeps cached. The dry run predicts
activations with the same counter (`torchpre.planner.activation_probe`).

Per train_step, as the max over ranks:
- `step_start_bytes`: tensor bytes live when the step begins (parameters, buffers, optimizer state, data),
- `activation_bytes`: bytes added by the forward and still live at the first op of backward, i.e.
  what autograd keeps for backward (activation checkpointing's target),
- `tensor_peak_bytes`: the highest total during the step (forward, recompute, backward, optimizer).

Rank 0 appends them to metrics.jsonl, one record per step (`step`, the fields above, `num_params`),
next to the trainer's records.   Usage: torchrun ... bench/memory_worker.py [train.py arguments]
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from torchpre.planner.tensor_memory import TensorMemory
from torchpre.runtime.cli import run_entry_point

FIELDS = ("step_start_bytes", "activation_bytes", "tensor_peak_bytes")


def main(argv: list[str]) -> None:
    from torchpre.config.job_config import JobConfig
    from torchpre.config.parser import parse_args
    from torchpre.training.trainer import Trainer

    config = parse_args(JobConfig, argv)
    memory = TensorMemory()
    with memory:
        trainer = Trainer(config)
        per_step = _measure_steps(trainer, memory)
        trainer.train()
    per_step = _max_over_ranks(per_step)
    if dist.get_rank() == 0:
        _append_records(Path(config.job.dump_folder) / "metrics.jsonl", per_step, trainer.job.num_params)


def _measure_steps(trainer, memory: TensorMemory) -> list[tuple[int, int, int]]:
    """Wraps trainer.train_step so that each step appends its numbers to the returned list (the step
    alone: not the setup, the logging or checkpointing between steps)."""
    per_step: list[tuple[int, int, int]] = []
    train_step = trainer.train_step

    def measured(microbatches, **kwargs):
        memory.begin_step()
        result = train_step(microbatches, **kwargs)
        per_step.append((memory.step_start, memory.at_backward - memory.step_start, memory.peak))
        return result

    trainer.train_step = measured
    return per_step


def _max_over_ranks(per_step: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Each number's maximum over ranks, as torchpre reports max_memory_bytes: the rank that runs out first."""
    values = torch.tensor(per_step, dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return [tuple(int(v) for v in row) for row in values.tolist()]


def _append_records(path: Path, per_step: list[tuple[int, int, int]], num_params: int) -> None:
    with path.open("a", encoding="utf-8") as file:
        for step, values in enumerate(per_step, start=1):
            file.write(json.dumps({"step": step, **dict(zip(FIELDS, values)), "num_params": num_params}) + "\n")


if __name__ == "__main__":
    run_entry_point(main, sys.argv[1:], prog="bench/memory_worker.py")
