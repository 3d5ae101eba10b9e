"""The planner's predictions against measurements on this machine, layout by layout.

For each layout below, `python -m torchpre.plan`'s own prediction (`torchpre.planner.predict`, with a machine profile
that `torchpre.planner.calibrate` measured here) is compared with:

- memory: the tensor peak of a training step on the busiest rank, measured by bench/memory_worker.py (the real
  Trainer under the storage counter that bench/memory.py reports), for the debug model;
- time: the median `step_time_s` of steps 3-8 of a plain train.py run (one thread per process), for the `bench`
  flavor (dim 512, 8 blocks), whose matmuls dominate a step more than the debug model's.

Targets (issue 18): |predicted - measured| / measured <= 10% for memory and <= 25% for time.

Usage: python -m bench.plan_check [--layouts 1F1B,...] [--profile cpu.json]
"""

import argparse
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.common import print_table, run_torchpre
from torchpre.config.job_config import JobConfig
from torchpre.config.parser import parse_args, to_toml
from torchpre.planner.hardware import Hardware, get_hardware
from torchpre.planner.layout_space import Layout, check
from torchpre.planner.predict import model_flops_per_token, predict

MEMORY_TOLERANCE = 0.10
TIME_TOLERANCE = 0.25
STEPS, WARMUP = 8, 2
BASE = ["--training.seq_len", "256", "--training.global_batch_size", "8", "--optimizer.lr", "1e-3"]
MEMORY_MODEL = ["--model.flavor", "debugmodel"]
TIME_MODEL = ["--model.flavor", "bench"]

# Two processes at most: this machine has two cores.
LAYOUTS: dict[str, Layout] = {
    "1p": Layout(dp=1, tp=1, pp=1, zero_stage=0, activation_checkpoint="none", microbatch_size=4),
    "1p-ac-full": Layout(dp=1, tp=1, pp=1, zero_stage=0, activation_checkpoint="full", microbatch_size=4),
    "dp2-zero0": Layout(dp=2, tp=1, pp=1, zero_stage=0, activation_checkpoint="none", microbatch_size=4),
    "dp2-zero1-ac-op": Layout(dp=2, tp=1, pp=1, zero_stage=1, activation_checkpoint="selective", microbatch_size=4),
    "dp2-zero1-ac-full": Layout(dp=2, tp=1, pp=1, zero_stage=1, activation_checkpoint="full", microbatch_size=2),
    "tp2-sp": Layout(dp=1, tp=2, pp=1, zero_stage=1, activation_checkpoint="none", microbatch_size=4),
    "pp2-1f1b": Layout(dp=1, tp=1, pp=2, zero_stage=1, activation_checkpoint="none", microbatch_size=2,
                       schedule="1F1B"),
    "pp2-gpipe-ac-full": Layout(dp=1, tp=1, pp=2, zero_stage=1, activation_checkpoint="full", microbatch_size=2,
                                schedule="GPipe"),
}  # fmt: skip


@dataclass(frozen=True)
class Row:
    name: str
    predicted_memory: int
    measured_memory: int
    predicted_time: float
    measured_time: float

    @property
    def memory_error(self) -> float:
        return (self.predicted_memory - self.measured_memory) / self.measured_memory

    @property
    def time_error(self) -> float:
        return (self.predicted_time - self.measured_time) / self.measured_time

    @property
    def passes(self) -> bool:
        return abs(self.memory_error) <= MEMORY_TOLERANCE and abs(self.time_error) <= TIME_TOLERANCE


def layout_config(layout: Layout, model: Sequence[str]) -> tuple[JobConfig, int]:
    """The job a layout runs (checked as start-up checks it) and its world size."""
    world = layout.dp * layout.tp * layout.pp
    base = parse_args(JobConfig, [*BASE, *model])
    return check(layout, base, world).config, world


def predicted(layout: Layout, model: Sequence[str], hardware: Hardware) -> tuple[int, float]:
    """(peak tensor bytes of the busiest rank, step seconds) as the planner predicts them."""
    world = layout.dp * layout.tp * layout.pp
    checked = check(layout, parse_args(JobConfig, [*BASE, *model]), world)
    prediction = predict(checked, hardware, world, model_flops_per_token(checked.config, checked.model_args))
    return prediction.peak.total_bytes, prediction.step.total_s


def measured_memory(layout: Layout, model: Sequence[str] = MEMORY_MODEL) -> int:
    """The tensor peak of the last step, max over ranks (bench/memory_worker.py); `model`'s keys override BASE's."""
    records = _run(layout, model, "bench/memory_worker.py", steps=3)
    return int(max(r["tensor_peak_bytes"] for r in records if r["step"] == 3 and "tensor_peak_bytes" in r))


def measured_time(layout: Layout) -> float:
    """The median step time after the warm-up steps, of a plain training run."""
    records = _run(layout, TIME_MODEL, "train.py", steps=STEPS)
    return statistics.median(r["step_time_s"] for r in records if r["step"] > WARMUP and "step_time_s" in r)


def _run(layout: Layout, model: Sequence[str], script: str, steps: int) -> list[dict]:
    config, world = layout_config(layout, model)
    config.training.steps, config.metrics.log_freq = steps, 1
    config.lr_scheduler.warmup_steps = 1
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "job.toml"
        path.write_text(to_toml(config), encoding="utf-8")
        return run_torchpre(["--job.config_file", str(path)], nproc=world, script=script)


def compare(name: str, hardware: Hardware) -> Row:
    layout = LAYOUTS[name]
    memory, _ = predicted(layout, MEMORY_MODEL, hardware)
    _, seconds = predicted(layout, TIME_MODEL, hardware)
    return Row(name, memory, measured_memory(layout), seconds, measured_time(layout))


def print_rows(rows: Sequence[Row], hardware: Hardware) -> None:
    print_table(
        f"Planner vs measured on this machine ({hardware.name}: {hardware.peak_flops / 1e9:.0f} GFLOP/s per "
        f"thread, gloo {hardware.intra_node_bw / 1e9:.2f} GB/s)",
        ["layout", "memory predicted MiB", "measured MiB", "error", "step predicted s", "measured s", "error", "ok"],
        [
            [r.name, f"{r.predicted_memory / 2**20:.1f}", f"{r.measured_memory / 2**20:.1f}", f"{r.memory_error:+.1%}",
             f"{r.predicted_time:.3f}", f"{r.measured_time:.3f}", f"{r.time_error:+.1%}", "yes" if r.passes else "NO"]
            for r in rows
        ],
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.plan_check", description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated names from LAYOUTS")
    parser.add_argument("--profile", default="", help="a machine profile JSON; default: calibrate now")
    args = parser.parse_args(argv)
    if args.profile:
        hardware = get_hardware(args.profile)
    else:
        from torchpre.planner.calibrate import calibrate

        hardware = calibrate()
    rows = [compare(name, hardware) for name in args.layouts.split(",")]
    print_rows(rows, hardware)
    sys.exit(0 if all(r.passes for r in rows) else 1)


if __name__ == "__main__":
    main()
