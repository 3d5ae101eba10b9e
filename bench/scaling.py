"""Throughput of the parallel layouts on 2 processes against one process, at the same global batch.

Trains the bench model (dim 512, 8 layers, seq_len 512) as dp1 (one process), dp2, tp2 and pp2
(1F1B, one sequence per pipeline microbatch) with one thread per process, and prints a Markdown
table: steady-state tokens/s (the median over the steps after warm-up), the speedup over dp1 and
the efficiency, speedup / processes. Every layout trains the same model on the same data, so the
loss at the last step matches dp1's to about 1e-4; the table shows it as a check.

    python -m bench.scaling               # the bench model, about 3 minutes on 2 idle cores
    python -m bench.scaling --debugmodel  # and the debug model at seq_len 256
    python -m bench.scaling --quick       # a tiny model, for tests (about 30 s on 2 idle cores)

Other jobs on the same cores slow the 2-process layouts more than dp1: with one other busy process
on 2 cores dp1 still gets a whole core, each rank of dp2 only two thirds of one, and a descheduled
rank stalls its peer at every collective. The "CPU share" column (CPU seconds of a run's processes
over wall seconds x processes, start-up included) and the load average under the table tell
whether the cores were free: near 1 they were. `--repeats N` runs every layout N times,
interleaved, and keeps each layout's fastest run.
"""

import argparse
import dataclasses
import os
import resource
import time
from collections.abc import Sequence
from dataclasses import dataclass

from bench.common import print_table, run_torchpre, steady, workload_args


@dataclass(frozen=True)
class Workload:
    """A model and batch that every layout trains, and how many steps measure it."""

    title: str
    flavor: str
    seq_len: int
    global_batch: int
    steps: int
    warmup: int


@dataclass(frozen=True)
class Layout:
    name: str
    nproc: int
    args: tuple[str, ...]


@dataclass(frozen=True)
class Result:
    layout: Layout
    tokens_per_sec: float
    losses: tuple[float, ...]  # per step, in order
    cpu_share: float  # CPU time of the run's processes / (wall time x processes)


# dp1 at dim 512 runs about 450 tokens/s on one core: 8 x 512 tokens is a 9 s step, 6 steps a minute.
BENCH = Workload("bench model (dim 512, 8 layers), seq_len 512", "bench", 512, 8, steps=6, warmup=2)
DEBUG = Workload("debug model (dim 256, 6 layers), seq_len 256", "debugmodel", 256, 8, steps=20, warmup=5)
QUICK = Workload("tiny model (dim 64, 2 layers), seq_len 64", "tiny", 64, 8, steps=6, warmup=2)


def layouts(global_batch: int) -> list[Layout]:
    """dp1 first (the reference), then each 2-process layout, all at `global_batch` sequences per step."""
    pp2 = ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B",
           "--parallelism.pipeline_parallel_microbatch_size", "1")
    return [
        Layout("dp1", 1, ("--training.local_batch_size", str(global_batch))),
        Layout("dp2", 2, ("--training.local_batch_size", str(global_batch // 2))),
        Layout("tp2", 2, ("--training.local_batch_size", str(global_batch),
                          "--parallelism.tensor_parallel_degree", "2")),
        Layout(f"pp2 (1F1B, {global_batch} microbatches)", 2, ("--training.local_batch_size", str(global_batch), *pp2)),
    ]


def train_args(workload: Workload) -> list[str]:
    return workload_args(workload.flavor, workload.seq_len, workload.global_batch, workload.steps)


def measure(workload: Workload, repeats: int = 1) -> list[Result]:
    """Each layout's steady tokens/s (the fastest of `repeats` runs, interleaved so that a busy
    moment of the machine does not hit one layout only) and its per-step losses."""
    best: dict[Layout, Result] = {}
    for _ in range(repeats):
        for layout in layouts(workload.global_batch):
            result = run_layout(workload, layout)
            if layout not in best or result.tokens_per_sec > best[layout].tokens_per_sec:
                best[layout] = result
    return list(best.values())


def run_layout(workload: Workload, layout: Layout) -> Result:
    """One training run; also how much of its cores it got: the CPU seconds of all its processes
    over (wall seconds x processes), near 1 on idle cores, well below when other jobs share them."""
    cpu_before, wall_before = _children_cpu_seconds(), time.perf_counter()
    records = run_torchpre([*train_args(workload), *layout.args], nproc=layout.nproc)
    cpu_share = (_children_cpu_seconds() - cpu_before) / ((time.perf_counter() - wall_before) * layout.nproc)
    losses = tuple(record["loss"] for record in records)
    return Result(layout, steady(records, "tokens_per_sec", workload.warmup), losses, cpu_share)


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def table_rows(results: Sequence[Result]) -> list[list[object]]:
    """One row per layout: tokens/s, speedup over the first (dp1), efficiency = speedup / processes."""
    reference = results[0].tokens_per_sec
    rows = []
    for result in results:
        speedup = result.tokens_per_sec / reference
        rows.append([
            result.layout.name,
            result.layout.nproc,
            result.tokens_per_sec,
            f"{speedup:.2f}",
            f"{speedup / result.layout.nproc:.2f}",
            f"{result.losses[-1]:.4f}",
            f"{result.cpu_share:.2f}",
        ])
    return rows


HEADERS = ["layout", "processes", "tokens/s", "speedup vs dp1", "efficiency", "loss at last step", "CPU share"]


def main(argv: Sequence[str] | None = None) -> dict[str, list[Result]]:
    """Prints a table per workload; returns the results by model flavor (for tests)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, help="optimizer steps per run (default: the workload's)")
    parser.add_argument("--quick", action="store_true", help="the tiny model only, for tests")
    parser.add_argument("--debugmodel", action="store_true", help="also the debug model at seq_len 256")
    parser.add_argument("--repeats", type=int, default=1, help="runs per layout; the fastest counts")
    options = parser.parse_args(argv)
    if options.steps is not None and options.steps < 2:
        parser.error("--steps must be at least 2 (one warm-up step, one measured)")
    if options.repeats < 1:
        parser.error("--repeats must be at least 1")
    workloads = [QUICK] if options.quick else [BENCH, DEBUG] if options.debugmodel else [BENCH]
    results = {}
    for workload in workloads:
        if options.steps is not None:
            warmup = min(workload.warmup, options.steps - 1)
            workload = dataclasses.replace(workload, steps=options.steps, warmup=warmup)
        load_before = os.getloadavg()[0]
        results[workload.flavor] = measure(workload, options.repeats)
        title = f"{workload.title}, global batch {workload.global_batch}, one thread per process"
        print_table(title, HEADERS, table_rows(results[workload.flavor]))
        print(
            f"\nMedian tokens/s over steps {workload.warmup + 1}-{workload.steps}; "
            f"1-minute load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after.",
            flush=True,
        )
    return results


if __name__ == "__main__":
    main()
