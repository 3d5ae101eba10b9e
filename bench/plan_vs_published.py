"""The planner's predictions against torchtitan's published H100 runs (issue 53), row by row.

torchtitan's `benchmarks/llama3_h100_202412_torchtitan.md` (torchtitan 9dec370, 2024-12-26) reports, for Llama 3.1
8B, 70B and 405B on Grand Teton hosts (8 x H100 SXM 96 GB HBM2e at 500 W per host, NVLink, 400 Gb/s RDMA per GPU),
the tokens per second per GPU at iteration 90 and the peak memory the CUDA caching allocator reserved (max over
GPUs). Each row here is that run's keys (torchtitan's llama3_*.toml of that commit: seq_len 8192, selective AC
'op'; bf16 parameters, fp32 reductions, AdamW, vocabulary 128,256, FSDP2 = ZeRO-3; with TP, sequence and loss
parallel as torchtitan applies them; a pipeline split into as many microbatches as stages, torchtitan's default, two
stages per rank for Interleaved 1F1B), counted by a dry run of the whole job (rank 0's tensor peak) and predicted by
`predict_fixed` on the `h100-96gb-hbm2e-500w` profile: the planner's tensor and reserved peaks, TPS/GPU and MFU
(against the H100 SXM bf16 peak, as torchtitan quotes it).

The model's two fitted efficiencies were fitted on the 8B rows (`ROWS`) only. The 70B and 405B rows (`HELD_OUT`)
check it: nothing was fitted to them, and they use what the 8B rows do not (tensor parallelism, pipelines).

Usage: python -m bench.plan_vs_published [--gpu NAME] [--plot published.png] [--no-dry-run] [--held-out]
"""

import argparse
import logging
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from torchpre.config.job_config import JobConfig
from torchpre.config.parser import parse_args
from torchpre.planner.dryrun import build_rank
from torchpre.planner.fixed import predict_fixed
from torchpre.planner.hardware import get_hardware
from torchpre.planner.predict import Prediction

GiB = 2**30
H100_SXM_BF16_PEAK = 989e12  # what torchtitan's MFU divides by (their footnote 2)
MODEL = ["--model.vocab_size", "128256", "--training.dataset", "synthetic",
         "--training.mixed_precision_param", "bfloat16", "--optimizer.reduce_dtype", "float32",
         "--optimizer.zero_stage", "3"]  # fmt: skip


@dataclass(frozen=True)
class Published:
    """One row of torchtitan's table: its run's shape and what it measured."""

    table: int
    gpus: int
    cp: int
    seq_len: int
    local_batch: int
    ac: str
    compile: bool
    float8: bool
    tps_per_gpu: float
    memory_gib: float
    flavor: str = "8B"
    tp: int = 1
    pp: int = 1
    schedule: str = ""  # with pp > 1: 1F1B or Interleaved1F1B

    @property
    def dp(self) -> int:
        return self.gpus // (self.cp * self.tp * self.pp)

    @property
    def stages_per_rank(self) -> int:
        return 2 if self.schedule == "Interleaved1F1B" else 1

    @property
    def name(self) -> str:
        extras = "+compile" * self.compile + "+float8" * self.float8
        degrees = "".join(f" {axis}{n}" for axis, n in (("cp", self.cp), ("tp", self.tp), ("pp", self.pp)) if n > 1)
        schedule = f" {self.schedule}" if self.pp > 1 else ""
        return f"t{self.table} {self.flavor} fsdp{self.dp}{degrees}{schedule} seq{self.seq_len // 1024}k " \
            f"ac:{self.ac}{extras}"

    def argv(self) -> list[str]:
        """The job's keys, as `python -m torchpre.plan --fixed` takes them."""
        keys = [*MODEL, "--model.flavor", self.flavor, "--training.seq_len", str(self.seq_len),
                "--training.local_batch_size", str(self.local_batch),
                "--training.global_batch_size", str(self.local_batch * self.dp),
                "--parallelism.data_parallel_degree", str(self.dp),
                "--parallelism.context_parallel_degree", str(self.cp), "--activation_checkpoint.mode", self.ac]
        if self.tp > 1:
            keys += ["--parallelism.tensor_parallel_degree", str(self.tp), "--parallelism.enable_sequence_parallel",
                     "--parallelism.enable_loss_parallel"]
        if self.pp > 1:
            microbatches = self.pp * self.stages_per_rank  # torchtitan's default: one per stage
            keys += ["--parallelism.pipeline_parallel_degree", str(self.pp),
                     "--parallelism.pipeline_parallel_schedule", self.schedule,
                     "--parallelism.pipeline_parallel_virtual_stages", str(self.stages_per_rank),
                     "--parallelism.pipeline_parallel_microbatch_size", str(self.local_batch // microbatches)]
        keys += ["--compile.enable"] * self.compile
        keys += ["--quantize.linear", "float8", "--quantize.recipe", "tensorwise"] * self.float8
        return keys


ROWS = (
    Published(1, 8, 1, 8192, 2, "selective", False, False, 5762, 82.4),
    Published(1, 8, 1, 8192, 2, "selective", True, False, 6667, 77.0),
    Published(1, 8, 1, 8192, 2, "selective", True, True, 8532, 76.8),
    Published(2, 8, 1, 32768, 1, "full", True, True, 3890, 83.9),
    Published(2, 8, 2, 65536, 1, "full", True, True, 2540, 84.2),
    Published(2, 8, 4, 131072, 1, "full", True, True, 1071, 84.0),
    Published(2, 8, 8, 262144, 1, "full", True, True, 548, 84.5),
    Published(3, 128, 1, 8192, 2, "selective", False, False, 5605, 67.0),
    Published(3, 128, 1, 8192, 2, "selective", True, False, 6514, 62.0),
    Published(3, 128, 1, 8192, 2, "selective", True, True, 8380, 61.8),
)  # fmt: skip
# Tables 4-6: 70B on 256 GPUs and 405B on 512, compiled with Float8. Table 4's "2D + AsyncTP" row and tables 5 and
# 6, which run AsyncTP, are compared all the same: the model does not overlap TP's collectives with the matmuls, so
# it predicts those rows slower by the TP communication AsyncTP hides.
HELD_OUT = (
    Published(4, 256, 1, 8192, 16, "full", True, True, 829, 71.9, flavor="70B", tp=8),
    Published(5, 512, 1, 8192, 32, "full", True, True, 100, 82.5, flavor="405B", tp=8, pp=8, schedule="1F1B"),
    Published(5, 512, 1, 8192, 32, "full", True, True, 128, 72.7, flavor="405B", tp=8, pp=8,
              schedule="Interleaved1F1B"),
    Published(6, 512, 1, 32768, 8, "full", True, True, 76, 75.3, flavor="405B", tp=8, pp=8, schedule="1F1B"),
    Published(6, 512, 2, 65536, 8, "full", True, True, 47, 75.9, flavor="405B", tp=8, pp=8, schedule="1F1B"),
    Published(6, 512, 4, 131072, 8, "full", True, True, 31, 77.1, flavor="405B", tp=8, pp=8, schedule="1F1B"),
    Published(6, 512, 8, 262144, 8, "full", True, True, 16, 84.9, flavor="405B", tp=8, pp=8, schedule="1F1B"),
)  # fmt: skip


@dataclass(frozen=True)
class Compared:
    row: Published
    prediction: Prediction
    dry_run_bytes: int | None = None  # rank 0's tensor peak, from a dry run of the whole job (`--dry-run`)

    @property
    def tensor_gib(self) -> float:
        return self.prediction.peak.total_bytes / GiB

    @property
    def reserved_gib(self) -> float:
        return self.prediction.reserved_bytes / GiB

    @property
    def tps_per_gpu(self) -> float:
        return self.prediction.tokens_per_sec / self.prediction.gpus

    @property
    def mfu(self) -> float:
        """Against the H100 SXM bf16 peak, as torchtitan quotes MFU for this platform."""
        return self.prediction.flops_per_token * self.tps_per_gpu / H100_SXM_BF16_PEAK

    @property
    def memory_error(self) -> float:
        return self.reserved_gib / self.row.memory_gib - 1

    @property
    def tps_error(self) -> float:
        return self.tps_per_gpu / self.row.tps_per_gpu - 1


def compare(row: Published, gpu: str, dry_run: bool = False) -> Compared:
    """The planner's prediction of the row's run and, with `dry_run`, the dry run's count of its rank 0."""
    config = parse_args(JobConfig, row.argv())
    counted = build_rank(config, row.gpus, 0, checkpoint=False).total_bytes if dry_run else None
    return Compared(row, predict_fixed(config, get_hardware(gpu), row.gpus), counted)


def compare_all(gpu: str, dry_run: bool = False, rows: Sequence[Published] = ROWS) -> list[Compared]:
    logging.getLogger("torchpre").setLevel(logging.WARNING)
    return [compare(row, gpu, dry_run) for row in rows]


def table(compared: Sequence[Compared]) -> str:
    """A Markdown table of every row and a summary line of the worst and median errors."""
    lines = [
        "| run | dry run GiB | tensor GiB | reserved GiB | published GiB | error | TPS/GPU | published | error | MFU |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in compared:
        counted = "" if c.dry_run_bytes is None else f"{c.dry_run_bytes / GiB:.1f}"
        memory = f"{counted} | {c.tensor_gib:.1f} | {c.reserved_gib:.1f} | {c.row.memory_gib:.1f}"
        memory += f" | {c.memory_error:+.1%}"
        tps = f"{c.tps_per_gpu:,.0f} | {c.row.tps_per_gpu:,.0f} | {c.tps_error:+.1%}"
        lines.append(f"| {c.row.name} | {memory} | {tps} | {c.mfu:.1%} |")
    memory = [abs(c.memory_error) for c in compared]
    tps = [abs(c.tps_error) for c in compared]
    lines.append(f"\nmemory error: worst {max(memory):.1%}, median {statistics.median(memory):.1%}; "
                 f"TPS/GPU error: worst {max(tps):.1%}, median {statistics.median(tps):.1%}")  # fmt: skip
    return "\n".join(lines)


def plot(compared: Sequence[Compared], path: Path) -> None:
    """Predicted against published, memory and TPS/GPU, with the y = x line and the error bands."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(10, 4.5))
    for ax, title, band, pairs in (
        (axes[0], "peak reserved memory, GiB", 0.10, [(c.row.memory_gib, c.reserved_gib) for c in compared]),
        (axes[1], "tokens/s per GPU", 0.20, [(c.row.tps_per_gpu, c.tps_per_gpu) for c in compared]),
    ):
        published, predicted = zip(*pairs)
        top = max(*published, *predicted) * 1.1
        ax.plot([0, top], [0, top], color="black", linewidth=0.8)
        ax.fill_between([0, top], [0, top * (1 - band)], [0, top * (1 + band)], alpha=0.15, label=f"±{band:.0%}")
        ax.scatter(published, predicted)
        ax.set(title=title, xlabel="published (torchtitan, H100 96 GB 500 W)", ylabel="predicted", xlim=(0, top),
               ylim=(0, top))
        ax.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.plan_vs_published", description=__doc__.split("\n")[0])
    parser.add_argument("--gpu", default="h100-96gb-hbm2e-500w", help="the hardware row or profile JSON")
    parser.add_argument("--plot", default="", help="draw predicted against published into this PNG")
    parser.add_argument("--no-dry-run", action="store_true", help="leave out the dry runs of whole jobs (faster)")
    parser.add_argument("--held-out", action="store_true",
                        help="the 70B and 405B rows the model was not fitted on, instead of the 8B rows")
    args = parser.parse_args(argv)
    compared = compare_all(args.gpu, dry_run=not args.no_dry_run, rows=HELD_OUT if args.held_out else ROWS)
    print(table(compared))
    if args.plot:
        plot(compared, Path(args.plot))


if __name__ == "__main__":
    main()
