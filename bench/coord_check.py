"""The coordinate check (µP's test, Yang et al. 2022): one config trained at several widths (and depths, for
complete_p), measuring on a fixed batch of text the RMS of each block's output and of the logits at init, and how far
each moves (the RMS of its change) after a few AdamW steps. Under µP every coordinate stays within a small factor
across widths; under the standard parametrization the updates grow with the width, the logits' change first.

Each width is the same job with model.dim (each depth with model.n_layers), trained in this process through the
trainer itself (its optimizer groups, multipliers and data): train.py flags after the tool's own set the model and
the optimizer. Defaults: the tiny flavor (its dim 64 is the base), AdamW at lr 1e-3 without warm-up, clipping or
weight decay, so that the parametrization alone sets the step sizes, trained on one fixed batch of 8 x 64 tokens (as
the mup package's coordinate check does) that is also the probe.

What µP keeps within a factor 2 is every change and the blocks' outputs. The logits at init shrink as 1/sqrt(width)
under µP by design (its output layer starts at the infinite-width limit, zero; the logit multiplier is base / width
over a matrix of constant scale), and after a few small steps they are still mostly that.

    python -m bench.coord_check --parametrization mup --plot docs/images/coord_check_mup.png
    python -m bench.coord_check --parametrization sp --plot docs/images/coord_check_sp.png
    python -m bench.coord_check --parametrization complete_p --depths 2,4,8 \
        --plot docs/images/coord_check_complete_p.png
    python -m bench.coord_check --parametrization mup --model.name moe     # any train.py flag after the tool's own

`--compare-mup` (needs the `mup` package) also runs the mup package's own coordinate check (`mup.get_coord_data`,
MuAdamW) on the same Llama model, made µP the package's way (MuReadout, set_base_shapes, its init), and checks that
its per-parameter learning rates and init equal torchpre's.
"""

import argparse
import logging
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common import REPO, print_table
from bench.one_batch import fixed_batch
from torchpre.config.job_config import JobConfig
from torchpre.config.parser import parse_args
from torchpre.distributed.process_groups import shutdown_distributed
from torchpre.parallel.api import ParallelModel
from torchpre.training.trainer import Trainer

WIDTHS = (64, 128, 256, 512)
DEFAULTS = [
    "--model.flavor", "tiny", "--optimizer.lr", "1e-3", "--optimizer.weight_decay", "0", "--training.max_norm", "0",
    "--lr_scheduler.warmup_steps", "0", "--lr_scheduler.decay_ratio", "0",
]  # fmt: skip
WITHIN = 2.0  # the bar: under µP each coordinate within a factor 2 across widths


@dataclass(frozen=True)
class Coordinates:
    """For each coordinate ("block 0", ..., "logits"): its RMS at init, after the steps, and of its change."""

    init: dict[str, float]
    after: dict[str, float]
    change: dict[str, float]

    def last_block(self) -> "Coordinates":
        """The last block's output (as "last block") and the logits: what models of different depths share."""
        last = f"block {len(self.init) - 2}"
        keep = {"last block": last, "logits": "logits"}
        return Coordinates(*({new: values[old] for new, old in keep.items()}
                             for values in (self.init, self.after, self.change)))  # fmt: skip


def coordinates(train_args: Sequence[str], steps: int, tokens: torch.Tensor) -> Coordinates:
    """Trains the job `train_args` describe for `steps` steps in this process (one rank), probing `tokens` before and
    after."""
    with tempfile.TemporaryDirectory() as folder:
        argv = [*train_args, "--training.steps", str(steps), "--metrics.log_freq", str(steps)]
        config = parse_args(JobConfig, [*argv, "--job.dump_folder", folder])
        trainer = Trainer(config)
        try:
            before = _probe(trainer.job.model, tokens)
            trainer.train()
            after = _probe(trainer.job.model, tokens)
        finally:
            shutdown_distributed()
    return Coordinates(
        init={name: _rms(value) for name, value in before.items()},
        after={name: _rms(value) for name, value in after.items()},
        change={name: _rms(after[name] - before[name]) for name in before},
    )


@torch.no_grad()
def _probe(model: ParallelModel, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each block's output and the logits of `tokens` (one process: the model is one part)."""
    (part,) = model.parts
    outputs: dict[str, torch.Tensor] = {}
    hooks = [
        block.register_forward_hook(lambda module, args, out, name=f"block {i}": outputs.__setitem__(name, out.clone()))
        for i, block in enumerate(part.layers.values())
    ]
    try:
        outputs["logits"] = model.forward_only(tokens.to(model.device)).clone()
    finally:
        for hook in hooks:
            hook.remove()
    return outputs


def _rms(tensor: torch.Tensor) -> float:
    return tensor.double().pow(2).mean().sqrt().item()


def spread(values: Sequence[float]) -> float:
    """The largest value over the smallest: 1 when a coordinate does not change with the width."""
    return max(values) / min(values)


def sweep(train_args: Sequence[str], key: str, values: Sequence[int], steps: int) -> dict[int, Coordinates]:
    """`coordinates` of the job at each of `values` of model.`key` (dim or n_layers), on one fixed batch."""
    with tempfile.TemporaryDirectory() as folder:
        data, tokens, _ = fixed_batch(Path(folder))
        runs = {
            value: coordinates([*train_args, *data, f"--model.{key}", str(value)], steps, tokens) for value in values
        }
    return {value: run.last_block() for value, run in runs.items()} if key == "n_layers" else runs


def largest_change_spread(runs: dict[int, Coordinates]) -> float:
    """The largest spread across the runs of a coordinate's change: about 1 under µP, growing with width under SP."""
    names = next(iter(runs.values())).change
    return max(spread([run.change[name] for run in runs.values()]) for name in names)


def print_sweep(title: str, runs: dict[int, Coordinates], label: str) -> None:
    """The three tables of a sweep, a column per width (or depth) and the spread across them."""
    sizes = list(runs)
    names = list(next(iter(runs.values())).init)
    for kind in ("init", "after", "change"):
        rows = []
        for name in names:
            values = [getattr(runs[size], kind)[name] for size in sizes]
            rows.append([name, *(f"{v:.3g}" for v in values), f"{spread(values):.2f}"])
        heading = {"init": "RMS at init", "after": "RMS after the steps", "change": "RMS of the change"}[kind]
        print_table(f"{title}: {heading}", [label, *map(str, sizes), "max / min"], rows)


def plot(runs_by_axis: dict[str, dict[int, Coordinates]], path: Path, title: str) -> None:
    """A panel per (axis, init / change): each coordinate's RMS against the width (or depth), log-log."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 4 * len(runs_by_axis)))
    FigureCanvasAgg(figure)
    for row, (axis, runs) in enumerate(runs_by_axis.items()):
        sizes = list(runs)
        for col, kind in enumerate(("init", "change")):
            ax = figure.add_subplot(len(runs_by_axis), 2, 2 * row + col + 1)
            for name in list(next(iter(runs.values())).init):
                ax.plot(sizes, [getattr(runs[size], kind)[name] for size in sizes], marker="o", label=name)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel(axis)
            ax.set_ylabel("RMS at init" if kind == "init" else "RMS of the change")
            ax.set_title(f"{title}: {'init' if kind == 'init' else 'change after the steps'}")
        ax.legend(fontsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    print(f"\nplot: {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parametrization", default="mup", choices=("sp", "mup", "complete_p"))
    parser.add_argument("--widths", default=",".join(map(str, WIDTHS)), help="model.dim values")
    parser.add_argument("--depths", default="", help="model.n_layers values (at the base width)")
    parser.add_argument("--steps", type=int, default=10, help="AdamW steps between the two probes")
    parser.add_argument("--plot", type=Path, help="write the plot here")
    parser.add_argument("--compare-mup", action="store_true", help="also run the mup package's coordinate check")
    options, train_flags = parser.parse_known_args(argv)
    logging.getLogger("torchpre").setLevel(logging.WARNING)
    train_args = [*DEFAULTS, "--model.parametrization", options.parametrization, *train_flags]
    runs = {"width (model.dim)": sweep(train_args, "dim", _ints(options.widths), options.steps)}
    if options.depths:
        runs["depth (model.n_layers)"] = sweep(train_args, "n_layers", _ints(options.depths), options.steps)
    for axis, axis_runs in runs.items():
        print_sweep(f"{options.parametrization}, {options.steps} steps, by {axis}", axis_runs, "coordinate")
        worst = largest_change_spread(axis_runs)
        print(f"\nlargest spread of a change across {axis}: {worst:.2f} "
              f"({'within' if worst <= WITHIN else 'beyond'} {WITHIN:g})")  # fmt: skip
    if options.plot:
        plot(runs, options.plot, options.parametrization)
    if options.compare_mup:
        from bench.mup_package import compare

        compare(_ints(options.widths), options.steps)


def _ints(text: str) -> list[int]:
    return [int(value) for value in text.split(",") if value]


if __name__ == "__main__":
    main()
