"""torchpre against a plain transformers training loop on the same model, tokens and optimizer.

For each model (the debug model and the bench model) and each mode (eager, and torch.compile in
both), runs train.py and bench/hf_loop.py one after the other, each in its own process with one
thread, and prints two Markdown tables: steady tokens/s with the ratio torchpre / transformers
against its target, and MFU of both loops against this CPU's fp32 matmul peak (measured the same
way, one thread) with torchpre's FLOP formula for both.

Usage: python -m bench.vs_transformers [--models debug,bench] [--steps N] [--warmup N] [--no-compile] [--quick]
"""

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from bench.common import REPO, print_table, run_torchpre, steady
from torchpre.data.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer
from torchpre.models.llama3.args import LLAMA3_FLAVORS, flops_per_token
from torchpre.models.llama3.model import Transformer

RATIO_TARGETS = {"eager": 1.00, "compiled": 1.05}
MFU_TARGET = 0.80


@dataclass(frozen=True)
class Setup:
    """One benchmarked model: its torchpre flavor and the batch shape both loops train on."""

    name: str
    flavor: str
    seq_len: int
    batch_size: int


SETUPS = {
    "tiny": Setup("tiny", "tiny", 64, 8),
    "debug": Setup("debug", "debugmodel", 256, 8),
    "bench": Setup("bench", "bench", 512, 8),
}


@dataclass(frozen=True)
class LoopResult:
    """What one training run yields: steady throughput and the loss before any update."""

    tokens_per_sec: float
    first_loss: float


@dataclass(frozen=True)
class Comparison:
    """Both loops on one model in one mode."""

    setup: Setup
    mode: str
    flops_per_token: int
    transformers: LoopResult
    torchpre: LoopResult

    @property
    def ratio(self) -> float:
        return self.torchpre.tokens_per_sec / self.transformers.tokens_per_sec

    def mfu(self, result: LoopResult, peak: float) -> float:
        """Model FLOPs utilisation with torchpre's FLOP formula, so both loops are counted alike."""
        return self.flops_per_token * result.tokens_per_sec / peak


@dataclass(frozen=True)
class Report:
    """What one invocation measured, for tests and callers."""

    peak_flops: float
    comparisons: list[Comparison]


def model_size(setup: Setup) -> tuple[int, int]:
    """(parameters, training FLOPs per token) of torchpre's model, built on the meta device."""
    vocab_size = load_tokenizer(DEFAULT_TOKENIZER_PATH).vocab_size
    args = dataclasses.replace(LLAMA3_FLAVORS[setup.flavor], vocab_size=vocab_size, max_seq_len=setup.seq_len)
    with torch.device("meta"):
        num_params = sum(p.numel() for p in Transformer(args).parameters())
    return num_params, flops_per_token(args, num_params, setup.seq_len)


def measure_peak_flops() -> float:
    """fp32 matmul FLOP/s of one thread in a fresh process, as train.py measures it; the best of a
    few tries, since other processes on the machine can only make a measurement lower."""
    code = (
        "import torch; from torchpre.metrics.flops import measure_matmul_flops; "
        "print(max(measure_matmul_flops(torch.device('cpu'), torch.float32) for _ in range(4)))"
    )
    return float(_run([sys.executable, "-c", code]).splitlines()[-1])


def run_transformers(setup: Setup, steps: int, warmup: int, compiled: bool) -> tuple[LoopResult, int]:
    """The baseline loop (bench/hf_loop.py) and its parameter count."""
    shape = ["--flavor", setup.flavor, "--seq-len", str(setup.seq_len), "--batch-size", str(setup.batch_size)]
    command = [sys.executable, "-m", "bench.hf_loop", *shape, "--steps", str(steps), "--warmup", str(warmup)]
    result = json.loads(_run([*command, *(["--compile"] if compiled else [])]).splitlines()[-1])
    return LoopResult(result["tokens_per_sec"], result["first_loss"]), result["num_params"]


def run_torchpre_loop(setup: Setup, steps: int, warmup: int, compiled: bool) -> LoopResult:
    """train.py on the same shape, one metrics record per step."""
    records = run_torchpre([
        "--model.flavor", setup.flavor,
        "--training.seq_len", str(setup.seq_len),
        "--training.local_batch_size", str(setup.batch_size),
        "--training.steps", str(steps),
        "--metrics.log_freq", "1",
        *(["--compile.enable"] if compiled else []),
    ])
    return LoopResult(steady(records, "tokens_per_sec", warmup), records[0]["loss"])


def compare(setup: Setup, mode: str, steps: int, warmup: int) -> Comparison:
    """Runs both loops, one after the other, after checking that both build the same model."""
    compiled = mode == "compiled"
    num_params, flops = model_size(setup)
    transformers, hf_params = run_transformers(setup, steps, warmup, compiled)
    if hf_params != num_params:
        raise RuntimeError(f"{setup.name}: transformers' model has {hf_params:,} parameters, torchpre's {num_params:,}")
    comparison = Comparison(setup, mode, flops, transformers, run_torchpre_loop(setup, steps, warmup, compiled))
    # Progress on stderr: the full benchmark takes many minutes before the tables print.
    print(f"{setup.name} {mode}: transformers {transformers.tokens_per_sec:,.0f} tok/s, torchpre "
          f"{comparison.torchpre.tokens_per_sec:,.0f} tok/s", file=sys.stderr, flush=True)
    return comparison


def print_report(comparisons: Sequence[Comparison], peak: float) -> None:
    """The throughput table, then the MFU table."""
    print_table(
        "torchpre vs transformers: tokens/s, one thread each, same model, tokens and optimizer",
        ["model", "mode", "transformers tok/s", "torchpre tok/s", "ratio", "target", "result"],
        [_throughput_row(c) for c in comparisons],
    )
    print_table(
        f"MFU against the measured fp32 matmul peak of one thread ({peak / 1e9:.1f} GFLOP/s)",
        ["model", "mode", "FLOPs/token", "transformers MFU", "torchpre MFU", "torchpre target", "result"],
        [_mfu_row(c, peak) for c in comparisons],
    )


def _throughput_row(c: Comparison) -> list[object]:
    target = RATIO_TARGETS[c.mode]
    return [c.setup.name, c.mode, c.transformers.tokens_per_sec, c.torchpre.tokens_per_sec, f"{c.ratio:.2f}x",
            f"{target:.2f}x", _verdict(c.ratio >= target)]


def _mfu_row(c: Comparison, peak: float) -> list[object]:
    hf_mfu, torchpre_mfu = c.mfu(c.transformers, peak), c.mfu(c.torchpre, peak)
    return [c.setup.name, c.mode, f"{c.flops_per_token / 1e6:.1f}M", f"{hf_mfu:.1%}", f"{torchpre_mfu:.1%}",
            f">= {MFU_TARGET:.0%}", _verdict(torchpre_mfu >= MFU_TARGET)]


def main(argv: Sequence[str] | None = None) -> Report:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="debug,bench", help=f"comma-separated, of {', '.join(SETUPS)}")
    parser.add_argument("--steps", type=int, help="steps per run (default 10; 6 with --quick)")
    parser.add_argument("--warmup", type=int, help="first steps not measured (default 3; 2 with --quick)")
    parser.add_argument("--no-compile", action="store_true", help="eager mode only")
    parser.add_argument("--quick", action="store_true", help="the tiny model, eager, a few steps: a smoke test")
    a = parser.parse_args(argv)
    models = ["tiny"] if a.quick else a.models.split(",")
    if unknown := set(models) - set(SETUPS):
        parser.error(f"unknown models {', '.join(sorted(unknown))}; choose from {', '.join(SETUPS)}")
    steps = a.steps if a.steps is not None else 6 if a.quick else 10
    warmup = a.warmup if a.warmup is not None else 2 if a.quick else 3
    modes = ["eager"] if a.quick or a.no_compile else ["eager", "compiled"]
    peak = measure_peak_flops()
    comparisons = [compare(SETUPS[name], mode, steps, warmup) for name in models for mode in modes]
    print_report(comparisons, peak)
    return Report(peak, comparisons)


def _run(command: Sequence[str]) -> str:
    """Runs a worker with one thread (as train.py runs) and returns its stdout."""
    result = subprocess.run(
        command, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True
    )
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    return result.stdout


def _verdict(passed: bool) -> str:
    return "pass" if passed else "fail"


if __name__ == "__main__":
    main()
