"""What the metrics cost at metrics.log_freq 1 on CPU: the record of every step, and timing every collective.

Two costs, measured separately because they land in different places:
- **the record** (reading the timers, gathering memory maxima and every rank's times, rank 0 writing
  metrics.jsonl and the step line) happens between steps; train.py measures it itself and logs it with the next
  record as `time/metrics_s`. Its share is time/metrics_s / (step_time_s + time/metrics_s).
- **collective timing** (`metrics.time_collectives`, the wrappers behind time/comm_*_s and the straggler
  metrics) runs inside every step: its share is the steady step time with it on over the step time with it off,
  less 1, from two runs (on a shared CPU this difference is noisy: a few percent either way is noise).

Usage: python -m bench.metrics_overhead [--steps N] [--repeats R] [--quick]
"""

import argparse
import statistics
from dataclasses import dataclass

from bench.common import print_table, run_torchpre, steady

MODEL = ["--model.flavor", "debugmodel", "--training.seq_len", "256", "--training.local_batch_size", "4"]
QUICK_MODEL = ["--model.flavor", "tiny", "--training.seq_len", "32", "--training.local_batch_size", "2"]
LAYOUTS = {
    "dp2": [],
    "pp2 (1F1B, 4 microbatches)": [
        "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "1",
    ],
}
WARMUP = 2


@dataclass(frozen=True)
class Row:
    """One layout's costs, as fractions of a step."""

    layout: str
    step_s: float  # steady step time, collectives timed
    record_s: float  # time/metrics_s
    untimed_step_s: float  # steady step time with metrics.time_collectives off

    @property
    def record_share(self) -> float:
        return self.record_s / (self.step_s + self.record_s)

    @property
    def timing_share(self) -> float:
        return self.step_s / self.untimed_step_s - 1


def measure(layout: str, model: list[str], steps: int, repeats: int) -> Row:
    """`repeats` pairs of runs of `steps` steps on 2 processes, log_freq 1, collectives timed then untimed,
    alternating so that a change in the machine's load hits both alike; the median over the repeats."""
    common = [*model, *LAYOUTS[layout], "--training.steps", str(steps), "--metrics.log_freq", "1"]
    timed, untimed = [], []
    for _ in range(repeats):
        timed.append(run_torchpre(common, nproc=2))
        untimed.append(run_torchpre([*common, "--metrics.time_collectives", "false"], nproc=2))
    return Row(
        layout,
        step_s=statistics.median(steady(records, "step_time_s", WARMUP) for records in timed),
        record_s=statistics.median(steady(records, "time/metrics_s", WARMUP) for records in timed),
        untimed_step_s=statistics.median(steady(records, "step_time_s", WARMUP) for records in untimed),
    )


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per run; the first 2 are not counted")
    parser.add_argument("--repeats", type=int, default=3, help="pairs of runs (timed, untimed) per layout")
    parser.add_argument("--quick", action="store_true", help="tiny model, 6 steps, dp2 only, 1 pair (for tests)")
    args = parser.parse_args(argv)
    if args.quick:
        model, layouts, args.steps, args.repeats = QUICK_MODEL, ["dp2"], 6, 1
    else:
        model, layouts = MODEL, list(LAYOUTS)
    rows = [measure(layout, model, args.steps, args.repeats) for layout in layouts]
    print_table(
        f"Metrics cost at log_freq 1, {'tiny' if args.quick else 'debug'} model, 2 processes, median of steps "
        f"{WARMUP + 1}-{args.steps} and of {args.repeats} runs each",
        ["layout", "step (s)", "record (s)", "record share", "step, collectives untimed (s)", "timing share"],
        [
            [row.layout, f"{row.step_s:.3f}", f"{row.record_s:.4f}", f"{100 * row.record_share:.1f}%",
             f"{row.untimed_step_s:.3f}", f"{100 * row.timing_share:+.1f}%"]
            for row in rows
        ],
    )
    return rows


if __name__ == "__main__":
    main()
