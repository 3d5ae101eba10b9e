"""How long one rank takes to build and initialise a large model, measured in one CPU process.

Rank 0 of a `--world`-rank job (tensor parallel `--tp`, the rest data parallel) under torch's fake process
group (no peers, no collectives run), with the trainer's own pieces (`torchpre.assembly.meta.meta_model`,
`parallel_plan`, `torchpre.parallel.parallelize`), for llama3 `--flavor` with its real vocabulary (128,256
tokens for the released flavors) at `--seq_len`:

- (a) build on the meta device and parallelize (TP sharding, nothing materialised),
- (c) `to_empty` + `ModelSpec.build.init_buffers`: the resume path, when a checkpoint will overwrite the weights,
- (b) `to_empty` + `ModelSpec.build.init_weights`: a fresh start. Each parameter is drawn in full from its own
  generator and this rank keeps its shard (layout-independent init), so every rank draws every value.

(c) runs before (b), so each peak RSS (the process's high-water mark, which only grows) is that of its path.
Prints a Markdown table.   Usage: python -m bench.startup [--flavor 8B --world 8 --tp 8 --dtype bfloat16]
"""

import argparse
import dataclasses
import gc
import resource
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from bench.common import print_table
from torchpre.assembly.meta import meta_model
from torchpre.assembly.plans import parallel_plan
from torchpre.config.job_config import JobConfig
from torchpre.config.parser import parse_args
from torchpre.distributed.parallel_dims import ParallelDims
from torchpre.models.registry import get_flavor, get_model_spec
from torchpre.parallel.api import ParallelModel, parallelize
from torchpre.parallel.ties import retie, tie_groups

GiB = 2**30


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def local_bytes(module: nn.Module) -> int:
    """Bytes of this rank's parameter shards (a tied Parameter once)."""
    params = {id(p): p for p in module.parameters()}.values()
    return sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in params)


def largest_full_fp32_bytes(module: nn.Module) -> int:
    """The largest full (unsharded) parameter in fp32: what init draws at once."""
    return max(p.numel() * 4 for p in module.parameters())


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="8B")
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--seq_len", type=int, default=8192)
    options = parser.parse_args(argv)
    torch.set_num_threads(1)  # one rank's share of a CPU host; also what the numbers below assume

    config = parse_args(JobConfig, [
        "--model.flavor", options.flavor,
        "--training.seq_len", str(options.seq_len),
        "--training.mixed_precision_param", options.dtype,
        "--parallelism.tensor_parallel_degree", str(options.tp),
    ])
    spec = get_model_spec(config.model.name)
    args = dataclasses.replace(get_flavor(config.model.name, options.flavor), max_seq_len=options.seq_len)
    plan = parallel_plan(config, spec, args, pipeline=None)
    dims = ParallelDims.from_degrees(dp=options.world // options.tp, tp=options.tp, pp=1, world_size=options.world)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=options.world)
    try:
        mesh = dims.build_mesh("cpu")
        ties = tie_groups(meta_model(config, spec, args), plan.tied_weights)  # materialising unties them

        def build() -> ParallelModel:
            return parallelize(meta_model(config, spec, args), mesh, plan, device=torch.device("meta"),
                               init_weights=lambda part: None)

        def materialise(init: Callable[[nn.Module], None]) -> float:
            part = build().parts[0]
            start = time.perf_counter()
            part.to_empty(device="cpu")
            retie(part, ties)
            init(part)
            seconds = time.perf_counter() - start
            sizes.update(local=local_bytes(part), full=largest_full_fp32_bytes(part))
            return seconds

        sizes: dict[str, int] = {}
        start = time.perf_counter()
        model = build()
        build_s = time.perf_counter() - start
        num_params = sum(p.numel() for p in model.parts[0].parameters())
        del model
        rows = [["(a) meta build + parallelize", build_s, peak_rss_bytes() / GiB]]
        resume_s = materialise(spec.build.init_buffers)
        rows.append(["(c) to_empty + init_buffers (resume)", resume_s, peak_rss_bytes() / GiB])
        gc.collect()
        seed = config.training.seed
        fresh_s = materialise(lambda part: spec.build.init_weights(part, seed))
        rows.append(["(b) to_empty + init_weights (fresh start)", fresh_s, peak_rss_bytes() / GiB])
    finally:
        dist.destroy_process_group()

    title = (
        f"Start-up of rank 0: llama3 {options.flavor} ({num_params / 1e9:.2f} B parameters), {options.dtype}, "
        f"world {options.world}, tp {options.tp}, one thread; this rank's shards {sizes['local'] / GiB:.2f} GiB, "
        f"largest full parameter in fp32 {sizes['full'] / GiB:.2f} GiB"
    )
    table = [[name, f"{seconds:.2f}", f"{rss:.2f}"] for name, seconds, rss in rows]
    print_table(title, ["phase", "seconds", "peak RSS so far (GiB)"], table)


if __name__ == "__main__":
    main()
