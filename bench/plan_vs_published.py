"""The planner's predictions against published training runs (issues 53 and 61), row by row.

The corpus is `bench/published_runs.py`: every row a published run on the planner's keys, with its source, layout,
precision and published throughput (and memory where published), predicted by `predict_fixed` on its source's
hardware row. The model's efficiencies are fitted on the calibration rows (Megatron-LM 2021's Tables 1 and 2,
MosaicML's H100 BF16 table, torchtitan's 8B rows: `--fit` prints the fit); every other row only evaluates it.

    python -m bench.plan_vs_published              torchtitan's 8B rows, each with a dry run of the whole job
    python -m bench.plan_vs_published --held-out   torchtitan's 70B and 405B rows
    python -m bench.plan_vs_published --all        the whole corpus: the table, the errors, which rows fit
    python -m bench.plan_vs_published --fit        the efficiencies that fit the calibration rows best

`--plot P.png` draws predicted against published; `--no-dry-run` leaves the dry runs out; `--rows TEXT` keeps the
rows whose name contains TEXT (e.g. `--all --rows "mosaic a100"`), to iterate on a part of the corpus.
"""

import argparse
import dataclasses
import logging
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.published_runs import CALIBRATION, CORPUS, TORCHTITAN_HELD_OUT_ROWS, TORCHTITAN_ROWS, Run
from torchpre.config.job_config import JobConfig
from torchpre.config.parser import parse_args
from torchpre.errors import ConfigError
from torchpre.planner.dryrun import build_rank
from torchpre.planner.given_layout import check_fixed, predict_fixed
from torchpre.planner.hardware import Hardware, get_hardware
from torchpre.planner.predict import Prediction

GiB = 2**30
ROWS, HELD_OUT = TORCHTITAN_ROWS, TORCHTITAN_HELD_OUT_ROWS
# The efficiencies `--fit` fits on each hardware row's calibration rows (the other fields are the rows' assumptions).
# The A100's calibration rows (Megatron-LM 2021) ran the fused softmax over whole s x s scores, not flash attention,
# which torchpre runs: they fit its matmul rate only.
FITTED = ("matmul_efficiency", "attention_efficiency")
FITTED_ON = {"a100-80gb": ("matmul_efficiency",)}


@dataclass(frozen=True)
class Compared:
    run: Run
    prediction: Prediction
    dry_run_bytes: int | None = None  # rank 0's tensor peak, from a dry run of the whole job (`--dry-run`)
    chosen: Run | None = None  # the values of the run's unstated knobs it was predicted at (`settle`)

    @property
    def row(self) -> Run:
        return self.run

    @property
    def tensor_gib(self) -> float:
        return self.prediction.peak.total_bytes / GiB

    @property
    def reserved_gib(self) -> float:
        return self.prediction.reserved_bytes / GiB

    @property
    def tps_per_gpu(self) -> float:
        return self.prediction.tokens_per_s_per_gpu

    @property
    def mfu(self) -> float:
        """Against the GPU's bf16 peak, as the sources quote MFU (torchtitan: the H100 SXM's)."""
        return self.prediction.flops_per_token * self.tps_per_gpu / self.prediction.hardware.peak_flops

    @property
    def memory_error(self) -> float | None:
        return None if self.run.memory_gib is None else self.reserved_gib / self.run.memory_gib - 1

    @property
    def tps_error(self) -> float:
        return self.tps_per_gpu / self.run.tokens_per_s_per_gpu - 1

    @property
    def fits(self) -> bool:
        return self.prediction.fits


def compare(run: Run, dry_run: bool = False, hardware: Hardware | None = None) -> Compared:
    """The planner's prediction of the run (on its source's hardware row, or `hardware`; a run with unstated knobs
    at the planner's choice of them: `settle`) and, with `dry_run`, the dry run's count of its rank 0."""
    if run.unstated:
        return settle(run, hardware)
    config = parse_args(JobConfig, run.argv())
    counted = build_rank(config, run.gpus, 0, checkpoint=False).total_bytes if dry_run else None
    prediction = predict_fixed(config, hardware or get_hardware(run.source.hardware), run.gpus)
    return Compared(run, prediction, counted)


def settle(run: Run, hardware: Hardware | None = None) -> Compared:
    """The run at the legal values of its unstated knobs (`Run.choices`; start-up refuses the others) predicted
    fastest among those that fit, as the planner's search ranks them, else the fastest: a published run ran, so
    those who ran it chose what ran fastest for them. One rule for every row with a knob its source does not state,
    instead of a value picked per row; `Compared.chosen` is the choice."""
    config = parse_args(JobConfig, run.argv())
    p = config.parallelism
    n_layers = check_fixed(config, run.gpus).model_args.n_layers
    candidates = []
    for choice in run.choices(n_layers + p.pipeline_parallel_embedding_layers + p.pipeline_parallel_output_layers):
        try:
            candidates.append(dataclasses.replace(compare(dataclasses.replace(choice, unstated=()), False, hardware),
                                                  run=run, chosen=choice))  # fmt: skip
        except ConfigError:
            continue
    fitting = [c for c in candidates if c.fits]
    return max(fitting or candidates, key=lambda c: c.tps_per_gpu)


def selected(rows: Sequence[Run], text: str) -> list[Run]:
    """The rows whose name contains `text` (all of them for "")."""
    return [row for row in rows if text in row.name]


def compare_all(rows: Sequence[Run] = ROWS, dry_run: bool = False) -> list[Compared]:
    logging.getLogger("torchpre").setLevel(logging.WARNING)
    return [compare(row, dry_run) for row in rows]


def table(compared: Sequence[Compared]) -> str:
    """torchtitan's rows as a Markdown table (tensor, reserved and published memory) and the worst and median
    errors."""
    lines = [
        "| run | dry run GiB | tensor GiB | reserved GiB | published GiB | error | TPS/GPU | published | error | MFU |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in compared:
        counted = "" if c.dry_run_bytes is None else f"{c.dry_run_bytes / GiB:.1f}"
        memory = f"{counted} | {c.tensor_gib:.1f} | {c.reserved_gib:.1f} | {c.run.memory_gib:.1f}"
        memory += f" | {c.memory_error:+.1%}"
        tps = f"{c.tps_per_gpu:,.0f} | {c.run.tokens_per_s_per_gpu:,.0f} | {c.tps_error:+.1%}"
        lines.append(f"| {c.run.name} | {memory} | {tps} | {c.mfu:.1%} |")
    memory = [abs(c.memory_error) for c in compared]
    tps = [abs(c.tps_error) for c in compared]
    lines.append(f"\nmemory error: worst {max(memory):.1%}, median {statistics.median(memory):.1%}; "
                 f"TPS/GPU error: worst {max(tps):.1%}, median {statistics.median(tps):.1%}")  # fmt: skip
    return "\n".join(lines)


@dataclass(frozen=True)
class Errors:
    """A set of rows' tokens/s errors: how many, the median of their sizes, the worst (signed), how many fit."""

    rows: int
    median: float
    worst: float
    fit: int

    @classmethod
    def of(cls, compared: Sequence[Compared]) -> "Errors":
        errors = [c.tps_error for c in compared]
        return cls(len(compared), statistics.median(abs(e) for e in errors), max(errors, key=abs),
                   sum(c.fits for c in compared))  # fmt: skip

    def line(self, label: str) -> str:
        return (f"{label}: {self.rows} rows, TPS/GPU error median {self.median:.1%}, worst {self.worst:+.1%}; "
                f"{self.fit} of {self.rows} predicted to fit")


def corpus_table(compared: Sequence[Compared]) -> str:
    """Every row: its source, whether it calibrates, the predicted allocator peak against what the card leaves it,
    tokens/s per GPU against the published; then the errors of the calibration and evaluation rows."""
    lines = [
        "| run | set | allocator GiB | of GiB | published GiB | TPS/GPU | published | error | MFU |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in compared:
        published = "" if c.run.memory_gib is None else f"{c.run.memory_gib:.1f}"
        card = c.prediction.hardware.allocator_bytes / GiB
        kind = "calibration" if c.run.source.calibration else "evaluation"
        chosen = f" (chosen: {c.chosen.pipeline_choice})" if c.chosen else ""
        lines.append(f"| {c.run.name}{chosen} | {kind} | {c.reserved_gib:.1f}{'' if c.fits else ' (does not fit)'} | "
                     f"{card:.1f} | {published} | {c.tps_per_gpu:,.0f} | {c.run.tokens_per_s_per_gpu:,.0f} | "
                     f"{c.tps_error:+.1%} | {c.mfu:.1%} |")  # fmt: skip
    return "\n".join([*lines, "", *summary_lines(compared)])


def summary_lines(compared: Sequence[Compared]) -> list[str]:
    """The errors of the calibration rows, of every evaluation row, of the evaluation rows issue 61's targets count
    (the sources torchpre can express: `Source.outside_target`), and of each source."""
    calibration = [c for c in compared if c.run.source.calibration]
    evaluation = [c for c in compared if not c.run.source.calibration]
    target = [c for c in evaluation if not c.run.source.outside_target]
    left_out = sorted({c.run.source.short for c in evaluation if c.run.source.outside_target})
    target_label = "evaluation only, the target's rows" + (f" (without {', '.join(left_out)})" if left_out else "")
    lines = [Errors.of(rows).line(label) for label, rows in (("calibration", calibration),
                                                            ("evaluation only", evaluation),
                                                            (target_label, target)) if rows]  # fmt: skip
    by_source: dict[str, list[Compared]] = {}
    for c in compared:
        by_source.setdefault(c.run.source.short, []).append(c)
    lines += [Errors.of(rows).line(f"  {source}") for source, rows in by_source.items()]
    return lines


def fit(rows: Sequence[Run], hardware: Hardware, fields: Sequence[str] = FITTED) -> dict[str, float]:
    """The values of `fields` (fractions of a peak) that minimise the sum of the rows' |log(predicted / published)|
    tokens/s on `hardware`: absolute, not squared, so that the few rows the model does not describe (DeepSpeed's
    ZeRO-3 over 768 and more A100s, 3x slower than its compute) move it no more than any other row. Each row is
    probed once and timed again for every candidate (`Prediction.on`); a coordinate search over a grid of 0.01."""
    logging.getLogger("torchpre").setLevel(logging.WARNING)
    predictions = [compare(row, hardware=hardware).prediction for row in rows]
    published = [row.tokens_per_s_per_gpu for row in rows]

    def loss(values: dict[str, float]) -> float:
        candidate = dataclasses.replace(hardware, **values)
        return sum(abs(math.log(max(p.on(candidate).tokens_per_s_per_gpu, 1e-9) / t))
                   for p, t in zip(predictions, published))  # fmt: skip

    values = {name: getattr(hardware, name) or hardware.matmul_efficiency for name in fields}
    return _coordinate_search(values, loss)


def _coordinate_search(values: dict[str, float], loss: Callable[[dict[str, float]], float]) -> dict[str, float]:
    """Each field in turn moved to the best of 0.05..1.0 (step 0.01) with the others held, until none moves."""
    grid = [round(0.05 + 0.01 * i, 2) for i in range(96)]
    best = loss(values)
    while True:
        moved = False
        for name in values:
            scores = {value: loss({**values, name: value}) for value in grid}
            value = min(scores, key=scores.get)
            if scores[value] < best - 1e-12:
                values, best, moved = {**values, name: value}, scores[value], True
        if not moved:
            return values


def plot(compared: Sequence[Compared], path: Path) -> None:
    """Predicted against published tokens/s per GPU (log scales), calibration and evaluation rows apart, with the
    y = x line and the ±20% band; memory where published."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4.8))
    for calibration, marker in ((True, "o"), (False, "^")):
        rows = [c for c in compared if c.run.source.calibration == calibration]
        label = "calibration" if calibration else "evaluation only"
        axes[0].scatter([c.run.tokens_per_s_per_gpu for c in rows], [c.tps_per_gpu for c in rows], marker=marker,
                        label=label, s=18)  # fmt: skip
        with_memory = [c for c in rows if c.run.memory_gib is not None]
        axes[1].scatter([c.run.memory_gib for c in with_memory], [c.reserved_gib for c in with_memory],
                        marker=marker, label=label, s=18)  # fmt: skip
    low, high = 5, 3e5
    axes[0].plot([low, high], [low, high], color="black", linewidth=0.8)
    axes[0].fill_between([low, high], [low * 0.8, high * 0.8], [low * 1.2, high * 1.2], alpha=0.15, label="±20%")
    axes[0].set(xscale="log", yscale="log", xlabel="published tokens/s per GPU", ylabel="predicted",
                title="throughput")  # fmt: skip
    axes[1].plot([0, 100], [0, 100], color="black", linewidth=0.8)
    axes[1].fill_between([0, 100], [0, 90], [0, 110], alpha=0.15, label="±10%")
    axes[1].set(xlabel="published GiB (allocator peak)", ylabel="predicted", title="memory", xlim=(0, 100),
                ylim=(0, 100))  # fmt: skip
    for ax in axes:
        ax.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.plan_vs_published", description=__doc__.split("\n")[0])
    parser.add_argument("--plot", default="", help="draw predicted against published into this PNG")
    parser.add_argument("--no-dry-run", action="store_true", help="leave out the dry runs of whole jobs (faster)")
    rows = parser.add_mutually_exclusive_group()
    rows.add_argument("--held-out", action="store_true", help="torchtitan's 70B and 405B rows, not its 8B rows")
    rows.add_argument("--all", action="store_true", help="every row of the corpus (bench/published_runs.py)")
    rows.add_argument("--fit", action="store_true", help="fit the efficiencies on each GPU's calibration rows")
    parser.add_argument("--rows", default="", help="only the rows whose name contains this text")
    args = parser.parse_args(argv)
    rows = selected(CALIBRATION if args.fit else CORPUS if args.all else HELD_OUT if args.held_out else ROWS, args.rows)
    if not rows:
        parser.error(f"--rows {args.rows!r} matches no row's name; names look like {CORPUS[0].name!r}")
    if args.fit:
        for name in dict.fromkeys(row.source.hardware for row in rows):
            hardware = get_hardware(name)
            calibration = [row for row in rows if row.source.hardware == name]
            print(f"{name} ({len(calibration)} rows): {fit(calibration, hardware, FITTED_ON.get(name, FITTED))}")
        return
    if args.all:
        compared = compare_all(rows)
        print(corpus_table(compared))
    else:
        compared = compare_all(rows, dry_run=not args.no_dry_run and not args.held_out)
        print(table(compared))
    if args.plot:
        plot(compared, Path(args.plot))


if __name__ == "__main__":
    main()
