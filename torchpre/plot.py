"""Plot training curves from the metrics.jsonl of one or more jobs.

  python -m torchpre.plot DUMP_FOLDER [DUMP_FOLDER ...] [-o OUT.png]

One panel per quantity against the step (loss, val_loss, lr, grad norm, tokens/s, MFU, pipeline
bubble, communication time, step time tail), shown when some run logged it. Each run is one curve
per metric, labelled with its folder's name (and the metric's name in a panel of several), so runs
overlay for comparison. Writes OUT.png (default: metrics.png) with matplotlib's Agg backend, no
display needed.
"""

import argparse
import dataclasses
import json
import logging
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchpre.confined import replacing_path
from torchpre.errors import TorchpreError
from torchpre.optional import import_optional
from torchpre.runtime.cli import run_entry_point

if TYPE_CHECKING:
    from matplotlib.figure import Figure

logger = logging.getLogger("torchpre")


@dataclasses.dataclass(frozen=True)
class Panel:
    """One plot: the metrics.jsonl keys it draws, the factor applied to their values for display, and the
    keys drawn dashed (a theoretical value next to the measured ones)."""

    title: str
    keys: tuple[str, ...]
    factor: float = 1.0
    dashed: tuple[str, ...] = ()


PANELS = (
    Panel("loss", ("loss",)),
    Panel("validation loss", ("val_loss",)),
    Panel("learning rate", ("lr",)),
    Panel("grad norm (before clipping)", ("grad_norm",)),
    Panel("tokens/s (whole job)", ("tokens_per_sec",)),
    Panel("MFU (%)", ("mfu",), factor=100.0),
    Panel(
        "pipeline bubble (idle fraction)",
        ("pipeline/bubble", "pipeline/bubble_max", "pipeline/bubble_theory"),
        dashed=("pipeline/bubble_theory",),
    ),
    Panel(
        "communication time (s per step)",
        ("time/comm_dp_s", "time/comm_tp_s", "time/comm_pp_s", "time/comm_ep_s", "time/comm_cp_s"),
    ),
    Panel("step time tail (s)", ("time/step_p50_s", "time/step_p90_s", "time/step_p99_s", "time/step_max_s")),
)
COLUMNS = 2

Run = tuple[str, list[dict[str, Any]]]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m torchpre.plot", description=__doc__.split("\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, metavar="DUMP_FOLDER", help="a job's job.dump_folder")
    parser.add_argument("-o", "--output", type=Path, default=Path("metrics.png"), help="PNG file to write")
    args = parser.parse_args(argv)
    figure = plot_runs([(folder.resolve().name, read_metrics(folder)) for folder in args.folders])
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with replacing_path(args.output) as temporary:  # a link at the name is replaced, never written through
        figure.savefig(temporary, dpi=120, format=args.output.suffix.removeprefix(".") or "png")
    logger.info("wrote %s", args.output)


def read_metrics(folder: Path) -> list[dict[str, Any]]:
    """The records of `folder/metrics.jsonl`, one per step in step order: a resumed job appends the steps it
    redid after a crash, and a step's last record is the one that counts. A missing or empty file is an
    error naming it, since a plot without one run's curves would silently mislead a comparison."""
    path = folder / "metrics.jsonl"
    if not path.is_file():
        raise TorchpreError(f"{path} does not exist; give the job.dump_folder of a training run.")
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        raise TorchpreError(f"{path} is empty: the run logged no step yet.")
    try:
        records = [json.loads(line) for line in lines]
    except json.JSONDecodeError as error:
        raise TorchpreError(f"{path} is not JSON lines: {error}.") from None
    return sorted({record["step"]: record for record in records}.values(), key=lambda record: record["step"])


def plot_runs(runs: list[Run]) -> "Figure":
    """A matplotlib Figure with a panel per quantity that any run logged, one curve per run and metric."""
    import_optional("matplotlib", "python -m torchpre.plot")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    logged = {key for _, records in runs for record in records for key in record}
    panels = [panel for panel in PANELS if logged.intersection(panel.keys)]
    rows = math.ceil(len(panels) / COLUMNS)
    figure = Figure(figsize=(6 * COLUMNS, 3.5 * rows), layout="constrained")
    FigureCanvasAgg(figure)
    for index, panel in enumerate(panels):
        axes = figure.add_subplot(rows, COLUMNS, index + 1)
        for name, records in runs:
            for key in panel.keys:
                points = [(record["step"], panel.factor * record[key]) for record in records if key in record]
                if points:
                    steps, values = zip(*points)
                    label = name if len(panel.keys) == 1 else f"{name}: {key.rsplit('/', 1)[-1]}"
                    style = "--" if key in panel.dashed else "-"
                    axes.plot(steps, values, style, label=label, marker="." if len(points) == 1 else None)
        axes.set_title(panel.title)
        axes.set_xlabel("step")
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    return figure


if __name__ == "__main__":
    run_entry_point(main, sys.argv[1:], prog="python -m torchpre.plot")
