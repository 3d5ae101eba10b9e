"""Plot training curves from the metrics.jsonl of one or more jobs.

  python -m torchpre.plot DUMP_FOLDER [DUMP_FOLDER ...] [-o OUT.png]

One panel per metric (loss, val_loss when a run has it, lr, grad norm, tokens/s, MFU) against the
step; each run is one curve per panel, labelled with its folder's name, so runs overlay for
comparison. Writes OUT.png (default: metrics.png) with matplotlib's Agg backend, no display needed.
"""

import argparse
import json
import logging
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchpre.cli import run_entry_point
from torchpre.errors import TorchpreError
from torchpre.optional import import_optional

if TYPE_CHECKING:
    from matplotlib.figure import Figure

logger = logging.getLogger("torchpre")

# (metrics.jsonl key, panel title, factor applied to the value for display)
PANELS = (
    ("loss", "loss", 1.0),
    ("val_loss", "validation loss", 1.0),
    ("lr", "learning rate", 1.0),
    ("grad_norm", "grad norm (before clipping)", 1.0),
    ("tokens_per_sec", "tokens/s (whole job)", 1.0),
    ("mfu", "MFU (%)", 100.0),
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
    figure.savefig(args.output, dpi=120)
    logger.info("wrote %s", args.output)


def read_metrics(folder: Path) -> list[dict[str, Any]]:
    """The records of `folder/metrics.jsonl`; a missing or empty file is an error naming it, since a plot
    without one run's curves would silently mislead a comparison."""
    path = folder / "metrics.jsonl"
    if not path.is_file():
        raise TorchpreError(f"{path} does not exist; give the job.dump_folder of a training run.")
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        raise TorchpreError(f"{path} is empty: the run logged no step yet.")
    try:
        return [json.loads(line) for line in lines]
    except json.JSONDecodeError as error:
        raise TorchpreError(f"{path} is not JSON lines: {error}.") from None


def plot_runs(runs: list[Run]) -> "Figure":
    """A matplotlib Figure with a panel per metric that any run logged, one curve per run in each."""
    import_optional("matplotlib", "python -m torchpre.plot")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = [panel for panel in PANELS if any(panel[0] in record for _, records in runs for record in records)]
    rows = math.ceil(len(panels) / COLUMNS)
    figure = Figure(figsize=(6 * COLUMNS, 3.5 * rows), layout="constrained")
    FigureCanvasAgg(figure)
    for index, (key, title, factor) in enumerate(panels):
        axes = figure.add_subplot(rows, COLUMNS, index + 1)
        for name, records in runs:
            points = [(record["step"], factor * record[key]) for record in records if key in record]
            if points:
                steps, values = zip(*points)
                axes.plot(steps, values, label=name, marker="." if len(points) == 1 else None)
        axes.set_title(title)
        axes.set_xlabel("step")
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    return figure


if __name__ == "__main__":
    run_entry_point(main, sys.argv[1:], prog="python -m torchpre.plot")
