"""Learning-rate transfer across width: the tiny model trained at several widths (model.dim; its dim 64 is the base)
over a sweep of learning rates a factor 2 apart, in the standard parametrization and under µP. Under µP the best
rate is the same grid point at every width (within one); under SP it moves down as the width grows.

Each run is train.py in its own process (one thread) on the default corpus: 8 x 64 tokens per step, AdamW with
weight decay 0.1, 10 warm-up steps, no clipping (so that the parametrization alone sets the step sizes); its final
loss is the mean training loss of the last 20 steps (one step's loss on 8 sequences is too noisy to rank runs). A run
that stops on a non-finite loss counts as diverged. `--jobs` runs go at once.

    python -m bench.lr_transfer --plot docs/images/lr_transfer.png        # 2 x 4 widths x 6 rates x 200 steps
    python -m bench.lr_transfer --quick                                   # a tiny sweep, for tests
"""

import argparse
import math
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.common import REPO, print_table, run_torchpre

WIDTHS = (64, 128, 256, 512)
LRS = tuple(2.0**-k for k in range(10, 4, -1))  # 2^-10 (9.8e-4) .. 2^-5 (3.1e-2)
PARAMETRIZATIONS = ("sp", "mup")
STEPS, FINAL_STEPS = 200, 20
TRAIN = [
    "--model.flavor", "tiny", "--training.seq_len", "64", "--training.local_batch_size", "8",
    "--lr_scheduler.warmup_steps", "10", "--training.max_norm", "0", "--metrics.log_freq", "1",
]  # fmt: skip
DIVERGED = math.inf

Sweep = dict[tuple[int, float], float]  # (width, lr) -> final loss


def final_loss(args: Sequence[str]) -> float:
    """The mean loss of the last FINAL_STEPS steps of one run; inf if it stopped on a non-finite loss."""
    try:
        records = run_torchpre(args)
    except RuntimeError as error:
        if "non-finite" in str(error) or "nan" in str(error).lower():
            return DIVERGED
        raise
    losses = [record["loss"] for record in records[-FINAL_STEPS:]]
    return statistics.mean(losses) if all(math.isfinite(loss) for loss in losses) else DIVERGED


def sweep(parametrization: str, widths: Sequence[int], lrs: Sequence[float], steps: int, jobs: int) -> Sweep:
    """Every (width, lr) run of one parametrization."""
    grid = [(width, lr) for width in widths for lr in lrs]

    def run(point: tuple[int, float]) -> float:
        width, lr = point
        return final_loss([*TRAIN, "--training.steps", str(steps), "--model.dim", str(width), "--optimizer.lr",
                           f"{lr:.10g}", "--model.parametrization", parametrization])  # fmt: skip

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return dict(zip(grid, pool.map(run, grid)))


def best_lrs(losses: Sweep, widths: Sequence[int], lrs: Sequence[float]) -> dict[int, float]:
    """Each width's best learning rate."""
    return {width: min(lrs, key=lambda lr: losses[width, lr]) for width in widths}


def grid_shift(best: dict[int, float], lrs: Sequence[float]) -> int:
    """How many grid points the best rates span across the widths (0: the same point at every width)."""
    points = [list(lrs).index(lr) for lr in best.values()]
    return max(points) - min(points)


def print_sweep(parametrization: str, losses: Sweep, widths: Sequence[int], lrs: Sequence[float], steps: int) -> None:
    best = best_lrs(losses, widths, lrs)
    rows = [
        [width, *(_cell(losses[width, lr], lr == best[width]) for lr in lrs), f"{best[width]:.2g}"] for width in widths
    ]
    title = f"{parametrization}: final loss (mean of the last {FINAL_STEPS} of {steps} steps) by width and lr"
    print_table(title, ["width", *(f"{lr:.2g}" for lr in lrs), "best lr"], rows)
    print(f"\nthe best learning rate moves {grid_shift(best, lrs)} grid point(s) across widths {list(widths)}")


def _cell(loss: float, best: bool) -> str:
    text = "diverged" if loss == DIVERGED else f"{loss:.3f}"
    return f"**{text}**" if best else text


def plot(sweeps: dict[str, Sweep], widths: Sequence[int], lrs: Sequence[float], path: Path) -> None:
    """A panel per parametrization: final loss against the learning rate, a curve per width, its best point marked."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(5 * len(sweeps), 4), layout="constrained")
    FigureCanvasAgg(figure)
    finite = [loss for losses in sweeps.values() for loss in losses.values() if loss != DIVERGED]
    for column, (parametrization, losses) in enumerate(sweeps.items()):
        axes = figure.add_subplot(1, len(sweeps), column + 1)
        best = best_lrs(losses, widths, lrs)
        for width in widths:
            points = [(lr, losses[width, lr]) for lr in lrs if losses[width, lr] != DIVERGED]
            line = axes.plot(*zip(*points), marker="o", label=f"width {width}")[0]
            axes.plot([best[width]], [losses[width, best[width]]], marker="*", markersize=14, color=line.get_color())
        axes.set_xscale("log", base=2)
        axes.set_ylim(min(finite) - 0.05, min(max(finite), min(finite) + 2.0))
        axes.set_xlabel("learning rate (optimizer.lr)")
        axes.set_ylabel("final training loss")
        axes.set_title(f"{parametrization} (best rate: star)")
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=90)
    print(f"\nplot: {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")


def main(argv: Sequence[str] | None = None) -> dict[str, Sweep]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", default=",".join(map(str, WIDTHS)))
    parser.add_argument("--parametrizations", default=",".join(PARAMETRIZATIONS))
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (one thread each)")
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--quick", action="store_true", help="the first 2 widths, 2 rates, 25 steps")
    options = parser.parse_args(argv)
    widths = [int(width) for width in options.widths.split(",")]
    lrs, steps = LRS, options.steps
    if options.quick:
        widths, lrs, steps = widths[:2], LRS[2:4], FINAL_STEPS + 5
    start = time.perf_counter()
    sweeps = {name: sweep(name, widths, lrs, steps, options.jobs) for name in options.parametrizations.split(",")}
    for name, losses in sweeps.items():
        print_sweep(name, losses, widths, lrs, steps)
    print(f"\n{len(sweeps) * len(widths) * len(lrs)} runs in {time.perf_counter() - start:.0f} s")
    if options.plot:
        plot(sweeps, widths, lrs, options.plot)
    return sweeps


if __name__ == "__main__":
    main()
