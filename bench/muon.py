"""Muon against AdamW: step time, Newton-Schulz FLOPs, the bytes Muon sends to see whole matrices, and loss curves.

(a) Step time. Both optimizers train the debug model (--quick: the tiny one) at seq_len 256 on 8 sequences per step,
on one process and on dp2 ZeRO-1 (4 per rank), one thread per process. A run's step time is its median over the steps
after warm-up; a row gives the fastest and the median of `--repeats` runs (interleaved, so that a busy moment of the
shared machine does not hit one row only), and the optimizer's own share (`time/optimizer_s`, fastest run).

Newton-Schulz FLOPs are reported here, apart: metrics.jsonl's MFU counts the model only (flops_per_token x tokens/s
over the peak, torchpre/models/llama3/args.py and torchpre/metrics/recorder.py), not the optimizer. One iteration on a
matrix with m <= n rows (a tall one is transposed) is three matmuls, X·Xᵀ, A·A and B·X: 2·m·m·n + 2·m·m·m + 2·m·m·n
FLOPs (a multiply-add is 2; the elementwise terms and the initial norm are left out), `muon_ns_steps` (5) iterations
per optimizer step, once per matrix whatever the data-parallel degree. Against that matrix's training FLOPs
(6·m·n per token, T tokens per step) this is 5·m·(4n + 2m)/(6n·T) <= 5·m/T: large for a small model on a small batch,
small at pretraining batches of millions of tokens.

(b) Communication. Under ZeRO each rank holds a shard of every hidden matrix; Muon assembles each whole on one owner
rank of the data-parallel group (torchpre/optim/whole_matrices.py) and sends the shards of the result back. A rank
sends its shard of each matrix another rank owns and, of each matrix it owns, the g - 1 other shards of the result:
with owners balanced by size, per rank and step in a group of g,

    sent bytes = 2·(g - 1)/g² · Σ 4·numel(hidden matrices)     (fp32)

exactly Σ 2·numel for g = 2 whenever each shard is half a matrix, whoever owns what. The table compares it with
metrics.jsonl's `optimizer_sent_bytes` (max over ranks) at dp2 ZeRO-1 and ZeRO-3. For scale, ZeRO's own gradient
reduce-scatter and parameter all-gather send 2·(g - 1)/g · 4 bytes per parameter, so Muon adds H/(g·P) to them
(H hidden-matrix elements of P parameters).

(c) Loss curves. Both optimizers train the tiny model on the default corpus for the same steps at each learning rate
of a small sweep (the same warm-up and decay; Muon's rate is scaled per matrix by the default `match_rms_adamw`,
Newton-Schulz in bf16); the table gives each run's final loss (the mean of the last 20 steps), the plot each
optimizer's best run.

Usage: python -m bench.muon [--repeats N] [--plot PATH] [--quick]
"""

import argparse
import math
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common import REPO, print_table, run_torchpre, steady, workload_args
from torchpre.models.llama3.args import LLAMA3_FLAVORS, flops_per_token
from torchpre.models.llama3.model import Transformer
from torchpre.optim.build import embeddings
from torchpre.optim.muon import hidden_matrices
from torchpre.plot import plot_runs

NS_STEPS = 5  # optimizer.muon_ns_steps's default
FP32_BYTES = 4
FINAL_STEPS = 20  # the final loss is the mean over this many last steps


@dataclass(frozen=True)
class Workload:
    """A model and batch that each optimizer trains, and the steps left out of the medians as warm-up."""

    flavor: str
    seq_len: int
    global_batch: int
    steps: int
    warmup: int = 0


TIMING = Workload("debugmodel", 256, 8, steps=10, warmup=3)
QUICK_TIMING = Workload("tiny", 64, 8, steps=3, warmup=1)
CURVES = Workload("tiny", 256, 8, steps=300)
QUICK_CURVES = Workload("tiny", 64, 8, steps=FINAL_STEPS)
LRS = (3e-3, 1e-2, 3e-2, 1e-1)
QUICK_LRS = (3e-3,)
PLOT = REPO / "docs/images/muon_loss.png"
QUICK_PLOT = Path(tempfile.gettempdir()) / "muon_loss_quick.png"  # not over the docs' image
OPTIMIZERS = {"AdamW": (), "Muon": ("--optimizer.name", "Muon")}


def layouts(global_batch: int) -> dict[str, tuple[int, tuple[str, ...]]]:
    """Name: (processes, options), each at `global_batch` sequences per step."""
    return {
        "1 process": (1, ("--training.local_batch_size", str(global_batch))),
        "dp2 ZeRO-1": (2, ("--training.local_batch_size", str(global_batch // 2), "--optimizer.zero_stage", "1")),
    }


def train_args(workload: Workload, *extra: str) -> list[str]:
    return [*workload_args(workload.flavor, workload.seq_len, workload.global_batch, workload.steps), *extra]


def meta_model(flavor: str) -> Transformer:
    with torch.device("meta"):
        return Transformer(LLAMA3_FLAVORS[flavor])


def hidden_shapes(flavor: str) -> list[torch.Size]:
    """The shapes of the matrices Muon steps in `flavor`, chosen by the optimizer's own rule (the flavor's vocabulary
    is the shipped tokenizer's, as in training)."""
    model = meta_model(flavor)
    params = dict(model.named_parameters())
    vocab_size = LLAMA3_FLAVORS[flavor].vocab_size
    return [params[name].shape for name in sorted(hidden_matrices(params.items(), vocab_size, [], embeddings([model])))]


def newton_schulz_flops(shapes: Sequence[torch.Size], steps: int = NS_STEPS) -> int:
    """FLOPs of one optimizer step's orthogonalisations: per iteration 4·m·m·n + 2·m³ on each m x n matrix, m <= n."""
    total = 0
    for shape in shapes:
        m, n = sorted(shape[-2:])
        total += math.prod(shape[:-2]) * (4 * m * m * n + 2 * m**3)
    return steps * total


def training_flops(workload: Workload) -> int:
    """The model's training FLOPs per optimizer step by torchpre's count (the one MFU uses)."""
    num_params = sum(p.numel() for p in meta_model(workload.flavor).parameters())
    per_token = flops_per_token(LLAMA3_FLAVORS[workload.flavor], num_params, workload.seq_len)
    return per_token * workload.seq_len * workload.global_batch


def sent_bytes_theory(shapes: Sequence[torch.Size], group: int) -> float:
    """Bytes a rank sends per step to assemble the fp32 hidden matrices over a group of `group` and return them."""
    return 2 * (group - 1) / group**2 * FP32_BYTES * sum(shape.numel() for shape in shapes)


def sent_bytes(records: list[dict]) -> int:
    """The most `optimizer_sent_bytes` any step of a run recorded."""
    return max(record["optimizer_sent_bytes"] for record in records)


def measure_sent_bytes(workload: Workload, zero_stage: int) -> int:
    """`optimizer_sent_bytes` of a short Muon run at dp2 and `zero_stage`."""
    local = ("--training.local_batch_size", str(workload.global_batch // 2))
    args = train_args(workload, *OPTIMIZERS["Muon"], *local, "--optimizer.zero_stage", str(zero_stage))
    return sent_bytes(run_torchpre(args, nproc=2))


def time_runs(workload: Workload, repeats: int) -> dict[tuple[str, str], list[list[dict]]]:
    """(optimizer, layout): the records of each of `repeats` runs, taken in turns."""
    runs: dict[tuple[str, str], list[list[dict]]] = {}
    for _ in range(repeats):
        for layout, (nproc, options) in layouts(workload.global_batch).items():
            for optimizer, choice in OPTIMIZERS.items():
                records = run_torchpre(train_args(workload, *options, *choice), nproc=nproc)
                runs.setdefault((optimizer, layout), []).append(records)
    return runs


def step_time_rows(runs: dict[tuple[str, str], list[list[dict]]], warmup: int) -> list[list[object]]:
    """Per (optimizer, layout): the fastest and the median run's step time, the fastest's tokens/s and optimizer
    time, and its step time over AdamW's fastest on the same layout."""
    fastest = {}
    rows = []
    for (optimizer, layout), repeats in runs.items():
        times = [steady(records, "step_time_s", warmup) for records in repeats]
        best = repeats[times.index(min(times))]
        fastest[optimizer, layout] = min(times)
        rows.append([
            optimizer, layout, f"{min(times):.3f}", f"{statistics.median(times):.3f}",
            steady(best, "tokens_per_sec", warmup), f"{steady(best, 'time/optimizer_s', warmup):.3f}",
            f"{min(times) / fastest['AdamW', layout]:.2f}x",
        ])  # fmt: skip
    return rows


def sweep(workload: Workload, lrs: Sequence[float]) -> dict[tuple[str, float], list[dict]]:
    """(optimizer, lr): the records of one run of `workload` at that peak learning rate on one process."""
    return {
        (optimizer, lr): run_torchpre(train_args(workload, *choice, "--optimizer.lr", str(lr)))
        for optimizer, choice in OPTIMIZERS.items()
        for lr in lrs
    }


def final_loss(records: list[dict]) -> float:
    """The mean loss of the last `FINAL_STEPS` steps: one step's loss on 8 sequences is too noisy to rank runs."""
    return statistics.mean(record["loss"] for record in records[-FINAL_STEPS:])


def best_runs(runs: dict[tuple[str, float], list[dict]]) -> dict[str, tuple[float, list[dict]]]:
    """Optimizer: (lr, records) of its run with the lowest final loss."""
    best: dict[str, tuple[float, list[dict]]] = {}
    for (optimizer, lr), records in runs.items():
        if optimizer not in best or final_loss(records) < final_loss(best[optimizer][1]):
            best[optimizer] = (lr, records)
    return best


def plot(best: dict[str, tuple[float, list[dict]]], path: Path) -> None:
    """torchpre.plot's loss and learning-rate panels for each optimizer's best run."""
    runs = [
        (f"{optimizer}, lr {lr:g}", [{key: r[key] for key in ("step", "loss", "lr")} for r in records])
        for optimizer, (lr, records) in best.items()
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    plot_runs(runs).savefig(path, dpi=80)


def main(argv: Sequence[str] | None = None) -> dict[str, object]:
    """Prints the tables and writes the plot; returns the measurements (for tests)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per row; the fastest and median are shown")
    parser.add_argument("--plot", type=Path, help=f"PNG of the curves (default: {PLOT}; --quick: {QUICK_PLOT})")
    parser.add_argument("--quick", action="store_true", help="the tiny model, few steps, one run each (for tests)")
    options = parser.parse_args(argv)
    if options.repeats < 1:
        parser.error("--repeats must be at least 1")
    timing, curves = (QUICK_TIMING, QUICK_CURVES) if options.quick else (TIMING, CURVES)
    repeats = 1 if options.quick else options.repeats
    plot_path = options.plot or (QUICK_PLOT if options.quick else PLOT)
    started, load_before = time.perf_counter(), os.getloadavg()[0]

    runs = time_runs(timing, repeats)
    print_table(
        f"Step time, {timing.flavor} at seq_len {timing.seq_len}, {timing.global_batch} sequences per step "
        f"(median of steps {timing.warmup + 1}-{timing.steps}; {repeats} runs each)",
        ["optimizer", "layout", "step s (fastest)", "step s (median)", "tokens/s", "optimizer s", "step vs AdamW"],
        step_time_rows(runs, timing.warmup),
    )

    shapes = hidden_shapes(timing.flavor)
    ns_flops, model_flops = newton_schulz_flops(shapes), training_flops(timing)
    print_table(
        f"Newton-Schulz FLOPs per optimizer step ({NS_STEPS} iterations; not in MFU)",
        ["model", "hidden matrices", "their elements", "NS GFLOP", "model training GFLOP", "NS / training"],
        [[timing.flavor, len(shapes), sum(s.numel() for s in shapes), f"{ns_flops / 1e9:.2f}",
          f"{model_flops / 1e9:.2f}", f"{ns_flops / model_flops:.1%}"]],
    )  # fmt: skip

    measured = {
        "dp2 ZeRO-1": max(sent_bytes(records) for records in runs["Muon", "dp2 ZeRO-1"]),
        "dp2 ZeRO-3": measure_sent_bytes(timing, zero_stage=3),
    }
    theory = sent_bytes_theory(shapes, group=2)
    print_table(
        f"Bytes one rank sends per step to assemble whole matrices, {timing.flavor} (max over ranks)",
        ["layout", "optimizer_sent_bytes", "theory 2(g-1)/g² · 4 · Σ numel", "measured / theory"],
        [[layout, value, theory, f"{value / theory:.4f}"] for layout, value in measured.items()],
    )
    num_params = sum(p.numel() for p in meta_model(timing.flavor).parameters())
    hidden = sum(s.numel() for s in shapes)
    print(f"\nAt g = 2 this adds {hidden / (2 * num_params):.0%} to ZeRO's own gradient and parameter traffic "
          f"(H/(g·P), H = {hidden:,} hidden-matrix elements of P = {num_params:,} parameters).")  # fmt: skip

    lrs = QUICK_LRS if options.quick else LRS
    losses = sweep(curves, lrs)
    best = best_runs(losses)
    print_table(
        f"Final loss (mean of the last {FINAL_STEPS} of {curves.steps} steps), {curves.flavor} at seq_len "
        f"{curves.seq_len}, {curves.global_batch} sequences per step, one process",
        ["optimizer", "lr", "final loss", "best"],
        [[optimizer, f"{lr:g}", f"{final_loss(records):.4f}", "best" if best[optimizer][0] == lr else ""]
         for (optimizer, lr), records in losses.items()],
    )  # fmt: skip
    plot(best, plot_path)
    (muon_lr, muon), (adamw_lr, adamw) = best["Muon"], best["AdamW"]
    print(
        f"\nBest Muon (lr {muon_lr:g}) {final_loss(muon):.4f} against best AdamW (lr {adamw_lr:g}) "
        f"{final_loss(adamw):.4f}; curves in {plot_path}. Took {(time.perf_counter() - started) / 60:.1f} min; "
        f"1-minute load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after.",
        flush=True,
    )
    return {"step_times": runs, "sent_bytes": measured, "theory": theory, "losses": losses}


if __name__ == "__main__":
    main()
