"""Measure this machine into a `Hardware` profile: what the step-time model needs, as one training rank sees it.

Every measurement runs at one thread, as each torchrun worker does (torchrun sets OMP_NUM_THREADS=1), and the
compute ones (matmul, memory bandwidth, op overhead) run in both processes of the gloo measurement at once: a
training step keeps every core of a CPU "node" busy, which lowers each core's clock and shares the memory bandwidth
(a core measured alone ran ~20% faster than the 2-process training steps it was to predict):
- peak_flops: the best square fp32 matmul rate (`torchpre.metrics.flops.measure_matmul_flops`), or the training-
  shaped GEMM's when that is faster; matmul_efficiency: the training-shaped GEMM ([1024, 512] x [512, 1536], a
  microbatch of 4 x 256 tokens through a 512 -> 1536 projection) over that peak.
- mem_bw: bytes moved per second by a large in-place add (reads two tensors, writes one).
- op_overhead_s: seconds per dispatched aten op of a tiny model's forward and backward, whose ops cost nothing but
  their dispatch: the per-op price the time model charges for each op the probe counts (autograd recording and
  backward graph traversal included, which a bare op loop would miss).
- latency_s, intra_node_bw = inter_node_bw: two gloo processes (one "node") time all-reduce and the reduce-scatter
  and all-gather torchpre's collectives call, at 64 KiB to 16 MiB; a relative least-squares fit of the time
  model's ring formula gives one latency and one bandwidth. reduce_scatter_as_all_reduce is set when gloo's
  reduce-scatter costs at least 3/4 of an all-reduce of the same buffer (a ring reduce-scatter costs 1/2; here it
  measures more than the all-reduce). Point-to-point sends are left out of the fit: `Hardware` has one bandwidth,
  the collectives carry the large DP and TP terms, and gloo's sends run ~2.5x faster than its collectives here, so
  the model's pipeline sends err slow.
- gpus_per_node = 2 (processes per node in the CPU checks), overlap = 0 (on 2 cores communication and compute
  compete for the same cores), memory_bytes = physical RAM, reserved_bytes = 0.
About 20-30 s on 2 cores.
"""

import os
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from torchpre.distributed.collectives import all_gather_flat, reduce_scatter_flat
from torchpre.metrics.flops import measure_matmul_flops
from torchpre.models.llama3.args import TransformerArgs
from torchpre.models.llama3.model import Transformer
from torchpre.planner.activation_probe import ProbeMode, probe_microbatch
from torchpre.planner.hardware import Hardware, save_profile
from torchpre.planner.time_model import MEMORY_TRAFFIC

GEMM_SHAPE = (1024, 512, 1536)  # [m, k] x [k, n]
GLOO_SIZES = (64 * 2**10, 2**20, 4 * 2**20, 16 * 2**20)
RS_AS_ALL_REDUCE = 0.75
# Ring steps and the fraction of the buffer each rank sends, at 2 ranks (time_model.collective_seconds).
RING_AT_2 = {"all_reduce": (2, 1.0), "reduce_scatter": (1, 0.5), "all_gather": (1, 0.5)}


def calibrate(out_path: Path | None = None, name: str = "calibrated-cpu", gloo: bool = True) -> Hardware:
    """Measures this machine (see the module docstring); writes the profile to `out_path` when given."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if gloo:
            latency, bw, rs_as_ar, (peak, efficiency, mem_bw, overhead) = measure_gloo()
        else:
            latency, bw, rs_as_ar, (peak, efficiency, mem_bw, overhead) = 0.0, float("inf"), False, measure_compute()
        subclass_overhead = measure_subclass_op_overhead(overhead)
    finally:
        torch.set_num_threads(threads)
    hardware = Hardware(
        name=name,
        peak_flops=peak,
        memory_bytes=float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
        reserved_bytes=0.0,
        intra_node_bw=bw,
        inter_node_bw=bw,
        latency_s=latency,
        gpus_per_node=2,
        matmul_efficiency=efficiency,
        mem_bw=mem_bw,
        op_overhead_s=overhead,
        overlap=0.0,
        reduce_scatter_as_all_reduce=rs_as_ar,
        subclass_op_overhead_s=subclass_overhead,
    )
    if out_path is not None:
        save_profile(hardware, out_path)
    return hardware


def measure_compute() -> tuple[float, float, float, float]:
    """(peak FLOP/s, matmul efficiency, memory bandwidth, op overhead) of this process. The efficiency is a
    training step's: the one that makes the time model's compute term equal a reference microbatch's measured
    forward + backward (`reference_efficiency`), which a lone GEMM overstates (allocation, cache and memory
    traffic between the matmuls of a real step)."""
    peak, _ = measure_matmul()
    mem_bw, overhead = measure_memory_bandwidth(), measure_op_overhead()
    return peak, reference_efficiency(peak, mem_bw, overhead), mem_bw, overhead


def reference_efficiency(peak: float, mem_bw: float, op_overhead_s: float, seconds: float = 3.0) -> float:
    """The matmul efficiency at which the time model predicts a reference microbatch exactly: a 2-block Llama
    (dim 256, 2,048-token vocabulary, 4 x 256 tokens) trained forward and backward with cross-entropy, counted
    by the activation probe on meta (FLOPs, bytes written, ops) and timed here (the median of its steps: a
    sustained rate, not a best case). Not the `bench` or debug flavors the planner is checked on."""

    args = TransformerArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=2048, max_seq_len=256)
    tokens = torch.randint(0, args.vocab_size, (4, args.max_seq_len))

    def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten())

    meta_tokens = tokens.to("meta")
    with torch.device("meta"):
        probe = probe_microbatch(Transformer(args), (meta_tokens,), loss_fn=lambda out: loss(out, meta_tokens))
    model = Transformer(args)
    model.init_weights(0)

    def step() -> None:
        loss(model(tokens), tokens).backward()

    step()
    times = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times) < 3:
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    measured = sorted(times)[len(times) // 2]
    rest = MEMORY_TRAFFIC * probe.other_bytes / mem_bw + probe.ops * op_overhead_s
    return min(1.0, max(0.05, probe.flops / peak / max(measured - rest, 1e-9)))


def measure_matmul(seconds: float = 1.0) -> tuple[float, float]:
    """(peak FLOP/s, the training-shaped GEMM's fraction of it) with this process's threads."""
    square = measure_matmul_flops(torch.device("cpu"), torch.float32, seconds=seconds / 2)
    m, k, n = GEMM_SHAPE
    a, b = torch.randn(m, k), torch.randn(k, n)
    per_call = _best_seconds(lambda: torch.mm(a, b), seconds / 2)
    shaped = 2 * m * k * n / per_call
    peak = max(square, shaped)
    return peak, shaped / peak


def measure_memory_bandwidth(numel: int = 2**24, seconds: float = 0.5) -> float:
    """Bytes/s of `a.add_(b)` on 64 MiB tensors (3 x 64 MiB moved per call), far beyond any cache."""
    a, b = torch.ones(numel), torch.ones(numel)
    return 3 * a.nbytes / _best_seconds(lambda: a.add_(b), seconds)


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def measure_op_overhead(seconds: float = 1.0) -> float:
    """Seconds per dispatched aten op of a 4-element MLP's forward + backward (see the module docstring): the
    fastest of several windows, as for the matmul (other load only slows a window down)."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.SiLU(), torch.nn.Linear(2, 2), torch.nn.RMSNorm(2))
    x = torch.randn(2, 2)

    def step() -> None:
        model(x).square().sum().backward()

    step()
    with _OpCounter() as counter:
        step()
    return _best_seconds(step, seconds) / counter.ops


def measure_subclass_op_overhead(op_overhead_s: float, seconds: float = 1.0) -> float:
    """Seconds each DTensor op costs on top of the local ops it runs: a tiny column- then row-parallel MLP's
    forward + backward on a one-rank mesh (no communication), timed, less its local ops at `op_overhead_s`, per
    DTensor dispatch the probe counts (`ActivationProbe.subclass_ops`). Joins a one-process gloo group when no
    process group exists."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    joined = not dist.is_initialized()
    if joined:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.SiLU(), torch.nn.Linear(8, 4))
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        x = torch.randn(2, 4)

        def step() -> None:
            model(x).square().sum().backward()

        step()
        counter = ProbeMode(("cpu",))
        with counter:
            step()
        local_ops = sum(counter.op_counts.values())
        per_step = _best_seconds(step, seconds)
        return max(per_step - local_ops * op_overhead_s, 0.0) / max(counter.subclass_ops, 1)
    finally:
        if joined:
            dist.destroy_process_group()


def _best_seconds(fn: Callable[[], object], seconds: float, windows: int = 5) -> float:
    """The fastest per-call time over `windows` windows of about seconds / windows each (load only slows)."""
    fn()
    best = float("inf")
    for _ in range(windows):
        calls, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / windows:
            fn()
            calls += 1
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def measure_gloo(repeats: int = 10) -> tuple[float, float, bool, tuple[float, float, float, float]]:
    """(latency s, bandwidth bytes/s, reduce-scatter runs as an all-reduce, `measure_compute` of rank 0 while
    rank 1 measures too) from two gloo processes."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "timings.pt"
        mp.spawn(_gloo_worker, args=(str(Path(folder) / "store"), str(out), repeats), nprocs=2, join=True)
        timings: dict = torch.load(out, weights_only=True)  # our own file, read as plain values all the same
    compute = timings.pop("compute")
    largest = max(GLOO_SIZES)
    rs_as_ar = timings["reduce_scatter", largest] >= RS_AS_ALL_REDUCE * timings["all_reduce", largest]
    samples = []
    for (op, nbytes), seconds in timings.items():
        steps, fraction = RING_AT_2["all_reduce" if op == "reduce_scatter" and rs_as_ar else op]
        samples.append((steps, fraction * nbytes, seconds))
    latency, bw = fit_latency_bandwidth(samples)
    return latency, bw, rs_as_ar, compute


def fit_latency_bandwidth(samples: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(latency, bw) minimising the relative error of seconds ~ steps x latency + sent_bytes / bw over samples of
    (steps, sent_bytes, seconds); latency is held at 0 if the unconstrained fit makes it negative."""
    # Weighted normal equations of t = steps x L + bytes x c, each row divided by its t (relative errors).
    rows = [(steps / t, nbytes / t) for steps, nbytes, t in samples]
    saa = sum(a * a for a, _ in rows)
    sab = sum(a * b for a, b in rows)
    sbb = sum(b * b for _, b in rows)
    sa1, sb1 = sum(a for a, _ in rows), sum(b for _, b in rows)
    det = saa * sbb - sab * sab
    latency, inverse_bw = (sa1 * sbb - sb1 * sab) / det, (saa * sb1 - sab * sa1) / det
    if latency < 0:
        latency, inverse_bw = 0.0, sb1 / sbb
    return latency, 1 / inverse_bw


def _gloo_worker(rank: int, store_path: str, out: str, repeats: int) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    group = dist.group.WORLD
    dist.barrier()
    timings: dict = {"compute": measure_compute()}  # both ranks at once, as training loads the node
    dist.barrier()
    for nbytes in GLOO_SIZES:
        full = torch.ones(nbytes // 4)
        half = torch.empty(nbytes // 8)
        runs = {
            "all_reduce": lambda: dist.all_reduce(full, group=group),
            "reduce_scatter": lambda: reduce_scatter_flat(half, full, group),
            "all_gather": lambda: all_gather_flat(full, half, group),
        }
        for op, run in runs.items():
            run()
            samples = []
            for _ in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                run()
                samples.append(time.perf_counter() - start)
            timings[op, nbytes] = min(samples)  # load only slows a run down
    if rank == 0:
        torch.save(timings, out)
    dist.barrier()
    dist.destroy_process_group()
