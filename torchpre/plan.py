"""Plan a run: `python -m torchpre.plan --job.config_file X.toml [--section.key v ...] --gpus N [options]`.

Enumerates the layouts of the job over N GPUs that torchpre's start-up accepts (dp x tp x pp x ep, ZeRO stage,
activation checkpointing, microbatch size, pipeline schedule), predicts each one's per-rank memory (the dry
run's own counts) and step time (`time_model`), and prints the fastest layouts that fit, then why the fastest
ones that do not fit do not. `--json` prints one JSON object instead; `--plot plan.png` draws the best ones;
`--calibrate OUT.json` measures this machine into a profile for `--gpu custom --gpu_profile OUT.json`; `--fixed`
evaluates the one layout the job's own keys set instead of searching.
"""

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from torchpre.config.job_config import JobConfig
from torchpre.config.parser import parse_args
from torchpre.errors import ConfigError
from torchpre.planner.hardware import HARDWARE, Hardware, get_hardware
from torchpre.runtime.cli import run_entry_point

if TYPE_CHECKING:
    from torchpre.planner.search import SearchResult

PROG = "python -m torchpre.plan"


def planner_arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, add_help=False, allow_abbrev=False)
    parser.add_argument("--gpus", type=int, default=0, help="GPUs the job runs on (the world size)")
    parser.add_argument("--gpus_per_node", type=int, default=0, help="GPUs per node (default: the GPU row's, 8)")
    parser.add_argument("--gpu", default="h100-80gb", help=f"{', '.join(HARDWARE)}, or custom (with --gpu_profile)")
    parser.add_argument("--gpu_profile", default="", help="a hardware profile JSON (written by --calibrate)")
    parser.add_argument("--top", type=int, default=5, help="how many of the fastest fitting layouts to print")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    parser.add_argument("--plot", default="", help="draw the best layouts' memory and step time into this PNG")
    parser.add_argument("--calibrate", default="", help="measure this machine into this profile JSON and exit")
    parser.add_argument("--workers", type=int, default=0, help="processes that measure layouts (default: one per core)")
    parser.add_argument("--fixed", action="store_true",
                        help="evaluate the layout the job's keys set (degrees, ZeRO, AC, microbatch, schedule, "
                        "compile, quantize) instead of searching")
    return parser


def main(argv: list[str]) -> None:
    planner, job_argv = planner_arguments().parse_known_args(argv)
    if planner.calibrate:
        from torchpre.planner.calibrate import calibrate

        hardware = calibrate(Path(planner.calibrate))
        print(json.dumps(dataclasses.asdict(hardware), indent=2))
        return
    config = parse_args(JobConfig, job_argv)
    hardware = _hardware(planner)
    if planner.gpus < 1:
        raise ConfigError(f"{PROG} needs --gpus N: the number of GPUs the job will run on.")
    logging.getLogger("torchpre").setLevel(logging.WARNING)  # the planner builds thousands of trainers
    from torchpre.planner.hf_flavor import planned_flavor  # torch loads here: a mistyped flag answers without it

    start = time.perf_counter()
    with planned_flavor(config) as planned:
        result = _fixed(planned, hardware, planner.gpus) if planner.fixed else _search(planned, hardware, planner)
    seconds = time.perf_counter() - start
    if planner.json:
        print(json.dumps(result.as_dict(planner.top) | {"seconds": round(seconds, 1)}, indent=1))
    else:
        print(result.table(planner.top))
        print(error_bars(result))
        print(f"planned in {seconds:.0f} s")
    if planner.plot:
        from torchpre.planner.plot import plot_layouts

        plot_layouts(result, planner.top, Path(planner.plot))


def error_bars(result: "SearchResult") -> str:
    """The best layout's allocator peak and TPS per GPU with the stated error of the predictions."""
    from torchpre.planner.predict import ERROR_BARS

    best = result.predictions[0]
    reserved, tensors = best.reserved_bytes / 2**30, best.peak.total_bytes / 2**30
    return (
        f"{best.checked.layout.describe()}: {reserved:.1f} GiB reserved by the CUDA allocator ({tensors:.1f} GiB of "
        f"tensors), {best.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, MFU {best.mfu:.1%}; stated error "
        f"±{ERROR_BARS['memory_gib']:.0%} memory, ±{ERROR_BARS['tokens_per_s_per_gpu']:.0%} tokens/s "
        "(docs/planning.md#checked-against-published-runs)"
    )


def _search(config: JobConfig, hardware: Hardware, planner: argparse.Namespace) -> "SearchResult":
    from torchpre.planner.search import search  # torch loads here: a mistyped flag answers without it

    workers = planner.workers or len(os.sched_getaffinity(0))
    return search(config, hardware, planner.gpus, progress=True, workers=workers)


def _fixed(config: JobConfig, hardware: Hardware, gpus: int) -> "SearchResult":
    """The job's own layout, predicted, as a one-layout result (refused by start-up's checks: their ConfigError)."""
    from torchpre.planner.given_layout import predict_fixed
    from torchpre.planner.search import SearchResult

    return SearchResult([predict_fixed(config, hardware, gpus)], 0, hardware, gpus, config)


def _hardware(planner: argparse.Namespace) -> Hardware:
    if planner.gpu == "custom":
        if not planner.gpu_profile:
            raise ConfigError("--gpu custom needs --gpu_profile PATH (a profile JSON, e.g. from --calibrate).")
        hardware = get_hardware(planner.gpu_profile, key="--gpu_profile")
    else:
        hardware = get_hardware(planner.gpu, key="--gpu")
    if planner.gpus_per_node:
        hardware = dataclasses.replace(hardware, gpus_per_node=planner.gpus_per_node)
    return hardware


if __name__ == "__main__":
    if any(arg in ("-h", "--help") for arg in sys.argv[1:]):
        planner_arguments().print_help()
        print("\nand every option of python -m torchpre.train (--help there lists them) for the job.")
        sys.exit(0)
    run_entry_point(main, sys.argv[1:], prog=PROG)
