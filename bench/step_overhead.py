"""Per-step host overhead on a tiny model, where the training loop's own machinery dominates: torchpre against a
bare PyTorch loop over the same model (bench/bare_loop.py) and, where torchtitan is importable, torchtitan 0.3.0's
real Trainer on the same shapes and tokens (bench/titan_llama.py's config, run on CPU by tests/bench/titan_on_cpu.py;
its attention is torchtitan's causal SDPA module, as FlexAttention, its default, has no backward on CPU).

Same model (Llama 3 `tiny`: dim 64, 2 layers, vocab 2048), sequences of 64, 8 per step, synthetic tokens, AdamW
(foreach) with clipping, logging every step, one process with one thread each. Each framework runs as a fresh
process twice, for `--short` and `--long` steps, and the marginal CPU time per step, (T_long - T_short) / (long -
short), leaves out start-up (imports, model build) and keeps everything a step costs, its logging included; CPU
time (user + system, from the operating system's accounting of the finished processes) rather than wall time, so
that other work on a shared machine does not count. The
frameworks take turns, `--repeats` rounds, and each figure is the median over the rounds; the ratio is taken
within each round, so a machine whose speed drifts still compares them fairly. torchpre and the bare loop train
the same model on the same tokens with the same optimizer and schedule, so their final losses agree (the work
compared is the same); torchtitan initialises its own way.

Usage: python -m bench.step_overhead [--short 40] [--long 240] [--repeats 3] [--quick]
"""

import argparse
import importlib.metadata
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.common import REPO, print_table
from bench.titan_config import config_name

SEQ_LEN, BATCH, VOCAB = 64, 8, 2048
TARGET = 1.0  # torchpre's step may cost no more than torchtitan's


def torchpre_command(steps: int, folder: str) -> list[str]:
    return [
        sys.executable, "train.py", "--model.flavor", "tiny", "--model.vocab_size", str(VOCAB),
        "--training.dataset", "synthetic", "--training.seq_len", str(SEQ_LEN),
        "--training.local_batch_size", str(BATCH), "--training.steps", str(steps), "--metrics.log_freq", "1",
        "--optimizer.implementation", "foreach", "--metrics.peak_flops", "1e12", "--job.dump_folder", folder,
    ]  # fmt: skip


def bare_command(steps: int, folder: str) -> list[str]:
    return [sys.executable, "-m", "bench.bare_loop", "--flavor", "tiny", "--seq-len", str(SEQ_LEN),
            "--batch-size", str(BATCH), "--steps", str(steps)]  # fmt: skip


def titan_on_cpu_command(steps: int, folder: str) -> list[str]:
    """torchtitan's own entry point with bench.titan_llama's config (torchpre's flavor, synthetic tokens) on CPU, in
    fp32 like the others, without activation checkpointing (torchtitan's debug config checkpoints selectively)."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
        "tests/bench/titan_on_cpu.py", "--module", "bench.titan_llama", "--config", config_name("tiny"),
        "--training.seq_len", str(SEQ_LEN), "--training.local_batch_size", str(BATCH),
        "--training.global_batch_size", str(BATCH), "--training.steps", str(steps),
        "--training.mixed_precision_param", "float32", "--optimizer.implementation", "foreach",
        "--lr_scheduler.warmup_steps", "10", "--metrics.log_freq", "1", "--metrics.disable_color_printing",
        "--dump_folder", folder, "activation-checkpoint:none",
    ]  # fmt: skip


FRAMEWORKS = {"torchpre": torchpre_command, "bare PyTorch loop": bare_command, "torchtitan": titan_on_cpu_command}


TITAN_VERSION = "0.3.0"  # bench/titan_llama.py speaks its config API (0.2.2's TOML and train specs are gone)


def titan_installed() -> str | None:
    """The installed torchtitan's version, None without one."""
    try:
        return importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class Run:
    seconds: float
    final_loss: float


def run(name: str, steps: int) -> Run:
    """One run of framework `name` as a fresh process with one thread: the CPU seconds (user + system) of its
    processes, which other work on the machine does not inflate as it does wall time, and its last step's loss.
    Fails with its output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get(
        "PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory() as folder:
        command = FRAMEWORKS[name](steps, folder)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        elapsed = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
        if name == "bare PyTorch loop":
            loss = float(result.stdout.split("final loss ")[-1])
        else:
            loss = json.loads((Path(folder) / "metrics.jsonl").read_text().splitlines()[-1])["loss"]
    return Run(elapsed, loss)


@dataclass(frozen=True)
class Round:
    """One framework in one round: marginal milliseconds per step and the long run's final loss."""

    ms_per_step: float
    final_loss: float


def measure(names: list[str], short: int, long: int, repeats: int) -> dict[str, list[Round]]:
    """Each framework's marginal ms/step, (T_long - T_short) / (long - short), in each round, the frameworks
    taking turns within a round."""
    rounds: dict[str, list[Round]] = {name: [] for name in names}
    for _ in range(repeats):
        for name in names:
            first, second = run(name, short), run(name, long)
            rounds[name].append(Round(1000 * (second.seconds - first.seconds) / (long - short), second.final_loss))
    return rounds


def report(rounds: dict[str, list[Round]]) -> list[list[object]]:
    """Rows: framework, median ms/step, torchpre's ratio to it (median of the per-round ratios), final loss."""
    mine = [r.ms_per_step for r in rounds["torchpre"]]
    rows = []
    for name, results in rounds.items():
        ratio = statistics.median(m / r.ms_per_step for m, r in zip(mine, results))
        median = statistics.median(r.ms_per_step for r in results)
        rows.append([name, f"{median:.2f}", f"{ratio:.2f}x", f"{results[-1].final_loss:.4f}"])
    return rows


def main(argv: list[str] | None = None) -> dict[str, list[Round]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--short", type=int, default=40, help="steps of the short run")
    parser.add_argument("--long", type=int, default=240, help="steps of the long run")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each figure is their median")
    parser.add_argument("--quick", action="store_true", help="one round of 10 and 30 steps (a smoke test)")
    options = parser.parse_args(argv)
    if options.quick:
        options.short, options.long, options.repeats = 10, 30, 1
    titan = titan_installed()
    names = ["torchpre", "bare PyTorch loop"] + (["torchtitan"] if titan == TITAN_VERSION else [])
    rounds = measure(names, options.short, options.long, options.repeats)
    title = (f"CPU time per step, tiny model (seq {SEQ_LEN}, batch {BATCH}), one thread, "
             f"{options.long - options.short} steps beyond start-up, median of {options.repeats}")  # fmt: skip
    print_table(title, ["loop", "ms/step", "torchpre / it", "final loss"], report(rounds))
    if "torchtitan" not in names:
        found = f"torchtitan {titan} is installed" if titan else "torchtitan is not installed"
        print(f"\n{found}: its row is left out (pip install torchtitan=={TITAN_VERSION}).")
    return rounds


if __name__ == "__main__":
    main()
