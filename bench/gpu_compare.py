"""torchpre and torchtitan 0.3.0 one after the other on the same Llama 3.2 shapes, tokens and global batch.

Each row of `ROWS` runs torchpre's train.py, then torchtitan's own entry point with bench/titan_llama.py's config,
for the same number of steps with random tokens over Llama 3's 128,256-id vocabulary, bf16, no activation
checkpointing and SDPA in both (PyTorch picks its flash kernel for bf16 causal attention; torchtitan's language
models default to FlexAttention since pytorch/torchtitan#3571, and its causal SDPA module is what the config takes
instead). The FP8 rows put the blocks' linears in float8 through torchao in both (rowwise scales; the output layer
stays bf16 in both); the tensorwise rows run torchpre alone, torchtitan 0.3.0 having dropped that recipe. The
DeepSeek-V3 row (issue 38: the `2B` flavor, MLA, 64 fine-grained experts as grouped bf16 matmuls, bias balancing,
one multi-token prediction depth, DeepSeek-V3's 129,280-id vocabulary) runs torchpre alone: torchtitan's deepseek_v3
has another flavor table, not ported here, so its cells say "not run". Rows run in priority order and
stop at the time budget, so the table fits one device call (`--only fp8` keeps the rows whose label says fp8).
Writes `gpu_table.md`, `gpu_raw.jsonl` (every step of every run) and `gpu_log.txt` (the tail of any failed run)
into --out.

    python -m bench.gpu_compare --out DIR [--steps 15] [--budget-s 420] [--only TEXT]
    python -m bench.gpu_compare --out DIR --smoke   (CPU: every row's command lines, without training)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from bench.common import REPO, steady
from bench.titan_config import config_name
from torchpre.metrics.flops import peak_flops
from torchpre.models.registry import get_model_spec  # importing torchpre.models registers every family

VOCAB_SIZE = 128256  # Llama 3's tokenizer
VOCAB_SIZES = {"llama3": VOCAB_SIZE, "deepseek_v3": 129280}  # each family's released tokenizer
WARMUP = 5  # steps left out of the median: compilation, allocator and cache warm-up


@dataclass(frozen=True)
class Row:
    flavor: str
    seq_len: int
    global_batch: int  # sequences per optimizer step, the same for both frameworks
    compile: bool
    nproc: int = 1
    cp: int = 1  # context-parallel degree: ranks that split each sequence
    fp8: str = ""  # the float8 recipe of the blocks' linears (quantize.recipe: tensorwise, rowwise); "": bf16
    model: str = "llama3"  # model.name; torchtitan runs the llama3 rows only
    mtp_depth: int = 0  # model.mtp_depth (deepseek_v3)

    @property
    def label(self) -> str:
        mode = "compiled" if self.compile else "eager"
        cp = f" cp{self.cp}" if self.cp > 1 else ""
        fp8 = f" fp8 {self.fp8}" if self.fp8 else ""
        family = "" if self.model == "llama3" else f"{self.model} "
        mtp = f" mtp{self.mtp_depth}" if self.mtp_depth else ""
        shape = f"{family}{self.flavor}{mtp} seq {self.seq_len} batch {self.global_batch}"
        return f"{shape} {mode} {self.nproc} GPU{cp}{fp8}"

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZES[self.model]

    @property
    def local_batch(self) -> int:
        """Sequences per data-parallel rank: the cp ranks of a sequence share it."""
        return self.global_batch // (self.nproc // self.cp)


# Most wanted first: the budget cuts from the end. The third is the long-context row (issue 36): one 32K sequence
# per step, unsharded on one GPU; TWO_GPU_ROWS split it over two cp ranks. The FP8 rows (issue 39) repeat the
# compiled 1B and 3B rows with float8 linears, beside their bf16 rows in the table. The DeepSeek-V3 row (issue 38)
# comes after the bf16 Llama rows at seq 4096: 2 sequences of 4,096 tokens per step (4 need 139 GiB by the dry run).
DEEPSEEK_V3_ROW = Row("2B", 4096, 2, compile=True, model="deepseek_v3", mtp_depth=1)
ROWS = (
    Row("1B", 4096, 4, compile=True),
    Row("1B", 4096, 4, compile=False),
    Row("1B", 32768, 1, compile=True),
    Row("3B", 4096, 2, compile=True),
    Row("3B", 4096, 2, compile=False),
    DEEPSEEK_V3_ROW,
    Row("1B", 4096, 4, compile=True, fp8="rowwise"),
    Row("1B", 4096, 4, compile=True, fp8="tensorwise"),
    Row("3B", 4096, 2, compile=True, fp8="rowwise"),
    Row("3B", 4096, 2, compile=True, fp8="tensorwise"),
    Row("1B", 8192, 2, compile=True),
    Row("3B", 8192, 1, compile=True),
)
TWO_GPU_ROWS = (Row("1B", 4096, 8, compile=True, nproc=2), Row("1B", 32768, 1, compile=True, nproc=2, cp=2))


def launcher(nproc: int, torchrun: bool = False) -> list[str]:
    """Plain Python for one process, torchrun for several (torchtitan always wants torchrun's LOCAL_RANK)."""
    if nproc == 1 and not torchrun:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def context_parallel(row: Row) -> list[str]:
    """The context-parallel flag, which both frameworks spell alike; none without cp."""
    return ["--parallelism.context_parallel_degree", str(row.cp)] if row.cp > 1 else []


def float8(row: Row) -> list[str]:
    """torchpre's flags for the row's float8 linears; none for bf16. torchtitan's are in its config
    (bench.titan_llama.config_name); both convert the blocks' linears and keep the output layer (tied to the
    embedding in 1B and 3B) in bf16."""
    return ["--quantize.linear", "float8", "--quantize.recipe", row.fp8] if row.fp8 else []


def family(row: Row) -> list[str]:
    """The model family's flags; none for Llama 3 (train.py's default)."""
    if row.model == "llama3":
        return []
    return ["--model.name", row.model, *(["--model.mtp_depth", str(row.mtp_depth)] if row.mtp_depth else [])]


def torchpre_command(row: Row, steps: int, folder: Path) -> list[str]:
    return [
        *launcher(row.nproc), "train.py", *family(row),
        "--model.flavor", row.flavor, "--model.vocab_size", str(row.vocab_size), "--training.dataset", "synthetic",
        "--training.seq_len", str(row.seq_len), "--training.local_batch_size", str(row.local_batch),
        "--training.steps", str(steps), "--training.mixed_precision_param", "bfloat16",
        "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1", "--job.dump_folder", str(folder),
        *(["--compile.enable"] if row.compile else []), *context_parallel(row), *float8(row),
    ]  # fmt: skip


def titan_command(row: Row, steps: int, folder: Path) -> list[str] | None:
    """torchtitan's own entry point and flags for the same run (its config from bench.titan_llama); None for the rows
    it does not run: not Llama 3, or float8 tensorwise, a recipe torchtitan 0.3.0 no longer has. On several GPUs
    torchtitan shards with FSDP, which cannot keep the tied embedding in one piece, so that row runs torchtitan untied
    (262M more parameters for the 1B)."""
    if row.model != "llama3" or row.fp8 == "tensorwise":
        return None
    return [
        *launcher(row.nproc, torchrun=True), "-m", "torchtitan.train", "--module", "bench.titan_llama",
        "--config", config_name(row.flavor, untied=row.nproc > 1, float8=row.fp8),
        "--training.seq_len", str(row.seq_len), "--training.local_batch_size", str(row.local_batch),
        "--training.global_batch_size", str(row.global_batch), "--training.steps", str(steps),
        "--training.mixed_precision_param", "bfloat16",
        "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1", "--metrics.disable_color_printing",
        "--dump_folder", str(folder), *(["--compile.enable"] if row.compile else []), *context_parallel(row),
        "activation-checkpoint:none",
    ]  # fmt: skip


def titan_check_command(command: list[str]) -> list[str]:
    """bench.titan_llama's `--check` of a torchtitan command line: the same launcher and flags."""
    at = command.index("torchtitan.train")  # followed by --module bench.titan_llama, which the check names itself
    return [*command[:at], "bench.titan_llama", "--check", *command[at + 3 :]]


def run(command: list[str], timeout_s: float, log: Path) -> bool:
    """Runs one job from the repository root; on failure or timeout appends its output's tail to `log`."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
        ok, output = result.returncode == 0, result.stdout + result.stderr
    except subprocess.TimeoutExpired as error:
        ok, output = False, f"timed out after {timeout_s:.0f} s\n{error.stdout or ''}{error.stderr or ''}"
    if not ok:
        with log.open("a") as file:
            file.write(f"\n## failed: {' '.join(command)}\n{output[-6000:]}\n")
    return ok


def peak_of(row: Row) -> float:
    """The GPU's datasheet peak the row's MFU is taken against: the FP8 one for the FP8 rows (torchpre's MFU line
    does the same), bf16 otherwise."""
    return peak_flops(torch.device("cuda"), linear="float8" if row.fp8 else "none")[0]


def flops_of(row: Row) -> int:
    """FLOPs per token of the row's model by torchpre's count (its family's: active parameters for DeepSeek-V3, its
    multi-token prediction included), the one used for both frameworks' MFU."""
    spec = get_model_spec(row.model)
    mtp = {"mtp_depth": row.mtp_depth} if row.mtp_depth else {}
    args = replace(spec.flavors[row.flavor], vocab_size=row.vocab_size, **mtp)
    with torch.device("meta"):
        num_params = sum(p.numel() for p in spec.build.model_cls(args).parameters())
    return spec.build.flops_per_token(args, num_params, row.seq_len)


def measure(row: Row, steps: int, work: Path, out: Path, timeout_s: float) -> list[object]:
    """One table row: both frameworks' steady tokens/s (per GPU), MFU, peak memory and the ratio."""
    cells: list[object] = [row.label]
    rates = []
    for name, command in (("torchpre", torchpre_command), ("torchtitan", titan_command)):
        folder = work / row.label.replace(" ", "_") / name
        line = command(row, steps, folder)
        if line is None:
            cells += ["not run", "", ""]
            rates.append(None)
            continue
        started = time.monotonic()
        ok = run(line, timeout_s, out / "gpu_log.txt")
        elapsed = time.monotonic() - started
        metrics = folder / "metrics.jsonl"
        if not ok or not metrics.exists():
            cells += ["failed", "", ""]
            rates.append(None)
            continue
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        with (out / "gpu_raw.jsonl").open("a") as file:
            for record in records:
                file.write(json.dumps({"row": row.label, "framework": name, **record}) + "\n")
        # torchpre logs the whole job's tokens/s and per device; torchtitan's "tps" is per device.
        rate = steady(records, "tokens_per_sec_per_device" if name == "torchpre" else "tokens_per_sec", WARMUP)
        rates.append(rate)
        mfu = rate * flops_of(row) / peak_of(row)
        memory = max(r["max_memory_bytes"] for r in records) / 2**30
        cells += [f"{rate:,.0f}", f"{mfu:.1%}", f"{memory:.1f}"]
        print(f"{row.label} {name}: {rate:,.0f} tok/s, MFU {mfu:.1%}, {memory:.1f} GiB ({elapsed:.0f} s)", flush=True)
    cells.append(f"{rates[0] / rates[1]:.2f}x" if None not in rates else "")
    return cells


HEADERS = [
    "run", "torchpre tok/s", "torchpre MFU", "torchpre peak GiB",
    "torchtitan tok/s", "torchtitan MFU", "torchtitan peak GiB", "torchpre / torchtitan",
]  # fmt: skip


def write_table(rows: list[list[object]], out: Path, notes: list[str]) -> None:
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    text = "\n".join(lines + [""] + notes) + "\n"
    (out / "gpu_table.md").write_text(text)
    print("\n" + text, flush=True)


def benchmark(args: argparse.Namespace) -> None:
    device = torch.cuda.get_device_name(0)
    rows = selected([*ROWS, *(TWO_GPU_ROWS if torch.cuda.device_count() >= 2 else ())], args.only)
    # Seconds a row takes, by compile mode: a guess until a row of that mode has run, then the longest seen.
    row_s, started, table, skipped = {True: 200.0, False: 90.0}, time.monotonic(), [], []
    for row in rows:
        left = args.budget_s - (time.monotonic() - started)
        if left < row_s[row.compile]:
            skipped.append(row.label)
            continue
        row_started = time.monotonic()
        table.append(measure(row, args.steps, args.work, args.out, timeout_s=left / 2))
        row_s[row.compile] = max(row_s[row.compile], time.monotonic() - row_started)
        write_table(table, args.out, [])
    notes = [
        f"One {device}, torch {torch.__version__}, {args.steps} steps, median tokens/s of the steps after "
        f"{WARMUP} (per GPU); MFU by torchpre's FLOP count against {peak_of(Row('1B', 1, 1, False)) / 1e12:.0f} "
        f"TFLOP/s for both ({peak_of(Row('1B', 1, 1, False, fp8='rowwise')) / 1e12:.0f}, the dense FP8 peak, in "
        "the fp8 rows). torchpre: bf16 parameters, fp32 master weights, peak = max allocated; torchtitan "
        "0.3.0: FSDP2's mixed precision (bf16 compute, fp32 parameters) on every GPU count, peak = max active. "
        "torchtitan runs neither the deepseek_v3 row (its own flavor table) nor the float8 tensorwise rows "
        "(a recipe 0.3.0 no longer has).",
        *([f"Skipped for the time budget: {', '.join(skipped)}."] if skipped else []),
    ]
    write_table(table, args.out, notes)


def selected(rows: list[Row], only: str) -> list[Row]:
    """The rows whose label contains `only` (all of them for "")."""
    return [row for row in rows if only in row.label]


def smoke(args: argparse.Namespace) -> None:
    """On CPU: torchpre's dry run of every row's command (it builds the real shape on meta and checks its
    memory against an H200; eager, as the dry run's memory probe cannot run under torch.compile) and
    torchtitan's `--check` of its command (flags accepted, same parameter count as torchpre, one tiny step),
    then `smoke_train`."""
    log, failures = args.out / "gpu_log.txt", 0
    for row in selected(list(ROWS), args.only)[: args.max_rows]:
        folder = args.work / row.label.replace(" ", "_")
        titan = titan_command(row, args.steps, folder / "torchtitan")
        checks = {
            "torchpre dry run": [*torchpre_command(replace(row, compile=False), args.steps, folder / "torchpre"),
                                 "--job.dry_run", "--job.dry_run_gpu", "h200-141gb",
                                 "--job.dry_run_world_size", str(row.nproc)],
            **({"torchtitan check": titan_check_command(titan)} if titan is not None else {}),
        }  # fmt: skip
        for name, command in checks.items():
            ok = run(command, 600, log)
            failures += not ok
            print(f"smoke {row.label}: {name} {'ok' if ok else 'FAILED'}", flush=True)
    failures += smoke_train(args.work, log)
    if failures:
        sys.exit(f"{failures} smoke check(s) failed: see {log}")


TINY_FLAVORS = {"llama3": "tiny", "deepseek_v3": "debugmodel"}


def smoke_train(work: Path, log: Path) -> int:
    """2 training steps of torchpre with the rows' flags on a tiny model of the row's family (its full vocabulary's
    embedding included), once per family and precision the rows use: Llama 3 in bf16 and in float8 with each recipe
    (emulated on a CPU: quantize.emulate = auto), DeepSeek-V3 with multi-token prediction in bf16. Returns how many
    failed."""
    failures = 0
    for model, mtp_depth, fp8 in dict.fromkeys((row.model, row.mtp_depth, row.fp8) for row in ROWS):
        tiny = Row(TINY_FLAVORS[model], 32, 2, compile=False, fp8=fp8, model=model, mtp_depth=mtp_depth)
        ok = run(torchpre_command(tiny, 2, work / tiny.label.replace(" ", "_")), 600, log)
        failures += not ok
        flags = (f"{model} mtp{mtp_depth} " if model != "llama3" else "") + (f"fp8 {fp8}" if fp8 else "bf16")
        print(f"smoke: torchpre trains 2 steps with the {flags} flags on a tiny model: {'ok' if ok else 'FAILED'}")
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu_table.md, gpu_raw.jsonl, gpu_log.txt")
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu_bench"), help="the runs' dump folders")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--budget-s", type=float, default=420, help="no row starts that would end past this")
    parser.add_argument("--smoke", action="store_true", help="CPU: check every command line without training")
    parser.add_argument("--max-rows", type=int, default=len(ROWS), help="with --smoke: the first N rows only")
    parser.add_argument("--only", default="", help="the rows whose label contains this text (e.g. fp8, 3B)")
    args = parser.parse_args()
    # A fresh start: the runs' dump folders, the raw file and the log would otherwise keep an earlier call's lines.
    shutil.rmtree(args.work, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in ("gpu_table.md", "gpu_raw.jsonl", "gpu_log.txt"):
        (args.out / name).unlink(missing_ok=True)
    smoke(args) if args.smoke else benchmark(args)


if __name__ == "__main__":
    main()
