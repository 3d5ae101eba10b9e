"""What the planner and the dry run know about a machine: one `Hardware` row per accelerator, or a JSON profile.

Imports no torch, so config validation (and `--help`) can name the choices. The rows hold datasheet numbers; the
efficiency fields are stated assumptions, not measurements: `python -m torchpre.plan --calibrate OUT.json`
measures them on the machine it runs on and writes a profile.

A profile is a JSON object with exactly the fields of `Hardware` (numbers in the units its docstring states), e.g.

    {"name": "my-gpu", "peak_flops": 5e14, "memory_bytes": 4.8e10, "reserved_bytes": 2e9,
     "intra_node_bw": 2e11, "inter_node_bw": 2.5e10, "latency_s": 1e-5, "gpus_per_node": 8, "nics_per_node": 8,
     "matmul_efficiency": 0.6, "mem_bw": 1.5e12, "op_overhead_s": 5e-6, "overlap": 1.0,
     "reduce_scatter_as_all_reduce": false, "subclass_op_overhead_s": 0.0, "fp8_peak_flops": 1e15}

Pass its path wherever a row name is accepted (`get_hardware`).
"""

import dataclasses
import difflib
import json
from dataclasses import dataclass
from pathlib import Path

from torchpre.confined import write_file
from torchpre.errors import ConfigError, InputFileError


@dataclass(frozen=True)
class Hardware:
    """One accelerator (or CPU process) and its links, as the time and memory models see it.

    name: the row's name, or the profile's.
    peak_flops: dense matmul FLOP/s of one device in the training dtype (bf16 on GPUs, fp32 on CPU).
    memory_bytes: memory of one device as the driver reports it (nvidia-smi's total), bytes.
    reserved_bytes: bytes of it outside the CUDA caching allocator (the CUDA context, NCCL's own buffers). A layout
        fits when its allocator peak (`torchpre.planner.allocator`) is at most `allocator_bytes`.
    intra_node_bw: bytes/s one device sends (per direction) to devices of its own node (NVLink).
    inter_node_bw: bytes/s one NIC sends (per direction) to other nodes.
    latency_s: seconds per step of a ring collective, and per point-to-point message.
    gpus_per_node: devices (ranks) per node: a group whose ranks span at most this many is intra-node.
    nics_per_node: the node's NICs, rail-optimised (NIC i on the rail of every node's device i); 0 = one per device.
        A collective over a group that spans nodes moves its inter-node bytes over the NICs of the group's ranks on
        each node, as NCCL's channels do (`torchpre.planner.time_model.group_seconds`).
    matmul_efficiency: the fraction of `peak_flops` a training-sized matmul reaches (an assumption unless measured).
    mem_bw: memory bandwidth of one device, bytes/s: what memory-bound (non-matmul) ops run at.
    op_overhead_s: seconds each eager op costs on top of its work (launch and dispatch).
    subclass_op_overhead_s: seconds each op on a tensor subclass (a DTensor under tensor parallelism) costs on top
        of the plain ops it runs: sharding propagation and redistribution planning in Python. Hidden behind the GPU
        when the GPU is the bottleneck (0 in the GPU rows); a CPU run pays it in full (calibration measures it).
    overlap: the fraction of backward time that data-parallel communication can hide behind (0 = none, 1 = all).
    reduce_scatter_as_all_reduce: the backend runs a reduce-scatter as a full all-reduce (a measured fact of a
        profile: calibration sets it when gloo's reduce-scatter costs as much as its all-reduce).
    fp8_peak_flops: dense FP8 matmul FLOP/s of one device (quantize.linear's matmuls, and MFU's peak under it);
        0 = no FP8 tensor cores (A100, CPUs): torchao emulates FP8 there, at `peak_flops`.
    fp8_matmul_efficiency: the fraction of `fp8_peak_flops` an FP8 matmul reaches; 0 = `matmul_efficiency`.
    attention_efficiency: the fraction of `peak_flops` attention kernels (flash attention, forward and backward)
        reach; 0 = `matmul_efficiency`.
    """

    name: str
    peak_flops: float
    memory_bytes: float
    reserved_bytes: float
    intra_node_bw: float
    inter_node_bw: float
    latency_s: float
    gpus_per_node: int
    matmul_efficiency: float
    mem_bw: float
    op_overhead_s: float
    overlap: float
    reduce_scatter_as_all_reduce: bool = False
    subclass_op_overhead_s: float = 0.0
    fp8_peak_flops: float = 0.0
    fp8_matmul_efficiency: float = 0.0
    attention_efficiency: float = 0.0
    nics_per_node: int = 0

    @property
    def allocator_bytes(self) -> float:
        """What the CUDA caching allocator may reserve: the device's memory less what lies outside it."""
        return self.memory_bytes - self.reserved_bytes

    @property
    def nic_bw_per_device(self) -> float:
        """Bytes/s of the node's NICs per device (per direction): each device's share when all send at once."""
        return (self.nics_per_node or self.gpus_per_node) * self.inter_node_bw / self.gpus_per_node


# Datasheet numbers (dense bf16 and FP8, SXM parts: NVIDIA prints FP8 with sparsity, 3,958 TFLOPS on H100/H200,
# half of it dense; A100 has no FP8). Links: NVLink per direction per GPU; between nodes 8 NICs per node,
# rail-optimised: 8 x 400 Gb/s on H100/H200 (DGX H100/H200: 8 ConnectX-7, 50 GB/s each) and 8 x 200 Gb/s on A100
# (DGX A100: 8 ConnectX-6 HDR for compute, 25 GB/s each). Memory as the driver reports it: 81,559 MiB on an H100
# SXM 80GB and 143,771 MiB on an H200 (nvidia-smi's total), 79.15 GiB on an A100 SXM4 80GB (cudaMemGetInfo's
# total). Assumptions: a matmul reaches 60% of peak, DP communication hides fully behind backward, ~5 us per eager op
# (CUDA launch + dispatch), 10 us per collective step (one figure for NVLink and InfiniBand: the inter-node value,
# the conservative one), 1 GiB outside the caching allocator (the CUDA context and NCCL's buffers; the allocator's
# own slack and workspaces are in its peak, `torchpre.planner.allocator`).
_GPU_ASSUMPTIONS = dict(
    reserved_bytes=2**30, latency_s=10e-6, gpus_per_node=8, nics_per_node=8, matmul_efficiency=0.6, op_overhead_s=5e-6,
    overlap=1.0,
)
# Meta's Grand Teton H100s, the platform of torchtitan's published benchmark (pytorch/torchtitan,
# benchmarks/llama3_h100_202412_torchtitan.md, "Hardware"): H100 SXM with 96 GB of HBM2e at 2.4 TB/s (memory_bytes,
# mem_bw), a 500 W power limit (the SXM's TDP is 700 W), 8 per host on NVLink 4 (intra_node_bw: 450 GB/s per
# direction, the H100 SXM datasheet), 400 Gb/s of RDMA per GPU (8 NICs per host of 50 GB/s). peak_flops and
# fp8_peak_flops: the H100 SXM datasheet's dense bf16 and FP8, which torchtitan's MFU divides by (its footnote 2:
# the 500 W part's own peak lies between SXM and NVL and is not known), so the power limit shows in the
# efficiencies. matmul_efficiency (0.58) and attention_efficiency (0.21): calibrated against that table's ten
# Llama 3.1 8B rows by least squares of the log TPS error, one value each for every row, no per-row factor
# (bench/plan_vs_published.py prints the errors; docs/planning.md#checked-against-published-runs); FP8 matmuls take
# matmul_efficiency (fp8_matmul_efficiency 0): the rows do not tell them apart (a free fit runs into any upper
# bound given, 0.75 of the FP8 peak, with the other errors nearly unchanged), and no larger fraction of the doubled
# peak is the conservative assumption under a power limit. latency_s, op_overhead_s, overlap, reserved_bytes: the
# other GPU rows' assumptions.
H100_96GB_HBM2E_500W = Hardware(
    "h100-96gb-hbm2e-500w", peak_flops=989e12, memory_bytes=96e9, intra_node_bw=450e9, inter_node_bw=50e9,
    mem_bw=2.4e12, fp8_peak_flops=1979e12, **{**_GPU_ASSUMPTIONS, "matmul_efficiency": 0.58},
    attention_efficiency=0.21,
)
# matmul_efficiency and attention_efficiency of h100-80gb (0.59, 0.18) and matmul_efficiency of a100-80gb (0.61,
# with its attention at A100_FLASH_ATTENTION_EFFICIENCY):
# fitted, by least absolute log errors of tokens/s, on the calibration rows of bench/published_runs.py alone
# (`python -m bench.plan_vs_published --fit`): MosaicML's H100 BF16 table (52 rows) and Megatron-LM 2021's Tables 1
# and 2 (22 rows, whose attention is a fused softmax over whole s x s scores, not the flash attention torchpre runs:
# they fit the matmul rate only). h200-141gb, the same GH100 chip, takes the H100's. FP8 matmuls take
# matmul_efficiency. Every other row of the corpus evaluates these (docs/planning.md#checked-against-published-runs).
_H100_FITTED = {"matmul_efficiency": 0.59, "attention_efficiency": 0.18}
# The A100's attention rate is a kernel benchmark's, not a fit: no calibration row runs flash attention on an A100.
# "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning" (Dao, arXiv 2307.08691),
# abstract: FlashAttention (the kernels of 2022-23, before FlashAttention-2) reaches "only 25-40% of the theoretical
# maximum FLOPs/s" on A100; this row takes the middle of that range, 0.325, as the rate of the attention FLOPs the
# probe counts (a backward counted as 2.5 forwards, the scores recomputed, as flash-attention's own
# benchmarks/benchmark_flash_attention.py counts them).
# FlashAttention-2 reaches 50-73% there: a job on FlashAttention-2 or later kernels attends faster than this row.
A100_FLASH_ATTENTION_EFFICIENCY = 0.325
HARDWARE: dict[str, Hardware] = {
    row.name: row
    for row in (
        Hardware("h100-80gb", peak_flops=989e12, memory_bytes=81_559 * 2**20, intra_node_bw=450e9, inter_node_bw=50e9,
                 mem_bw=3.35e12, fp8_peak_flops=1979e12, **{**_GPU_ASSUMPTIONS, **_H100_FITTED}),
        Hardware("h200-141gb", peak_flops=989e12, memory_bytes=143_771 * 2**20, intra_node_bw=450e9, inter_node_bw=50e9,
                 mem_bw=4.8e12, fp8_peak_flops=1979e12, **{**_GPU_ASSUMPTIONS, **_H100_FITTED}),
        Hardware("a100-80gb", peak_flops=312e12, memory_bytes=79.15 * 2**30, intra_node_bw=300e9, inter_node_bw=25e9,
                 mem_bw=2.0e12, attention_efficiency=A100_FLASH_ATTENTION_EFFICIENCY,
                 **{**_GPU_ASSUMPTIONS, "matmul_efficiency": 0.61}),
        H100_96GB_HBM2E_500W,
    )
}


def get_hardware(name_or_path: str, key: str = "hardware") -> Hardware:
    """A row of `HARDWARE` by name, or the profile at a path ending in .json; else a ConfigError naming `key`."""
    if name_or_path in HARDWARE:
        return HARDWARE[name_or_path]
    if name_or_path.endswith(".json"):
        return load_profile(Path(name_or_path), key)
    close = difflib.get_close_matches(name_or_path, list(HARDWARE), n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    raise ConfigError(
        f"{key} = '{name_or_path}' is not a known GPU.{hint} Choose one of: {', '.join(HARDWARE)}, or give the "
        "path of a JSON profile (python -m torchpre.plan --calibrate OUT.json writes one for this machine)."
    )


def save_profile(hardware: Hardware, path: Path) -> None:
    """Writes `hardware` as a JSON profile that `load_profile` reads back equal (a new file renamed into place: a
    symbolic link at `path` is replaced, never written through)."""
    write_file(path, json.dumps(dataclasses.asdict(hardware), indent=2) + "\n")


def load_profile(path: Path, key: str = "hardware") -> Hardware:
    """The `Hardware` a JSON profile describes; a missing file, bad JSON or wrong fields is a ConfigError."""
    try:
        fields = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{key} = '{path}': no such profile file.") from None
    except json.JSONDecodeError as error:
        raise InputFileError(f"{key} = '{path}' is not valid JSON: {error}.") from None
    if not isinstance(fields, dict):
        raise InputFileError(f"{key} = '{path}' must hold a JSON object of Hardware fields.")
    names = {field.name for field in dataclasses.fields(Hardware)}
    required = {field.name for field in dataclasses.fields(Hardware) if field.default is dataclasses.MISSING}
    unknown, missing = sorted(set(fields) - names), sorted(required - set(fields))
    if unknown or missing:
        raise InputFileError(
            f"{key} = '{path}': " + "; ".join(
                part for part in (unknown and f"unknown fields {', '.join(unknown)}",
                                  missing and f"missing fields {', '.join(missing)}") if part
            ) + f". A profile holds: {', '.join(sorted(names))}."
        )
    _check_values(fields, path, key)
    return Hardware(**fields)


def _check_values(fields: dict, path: Path, key: str) -> None:
    """Numbers where numbers go, positive where zero would divide, fractions within [0, 1]."""
    for field in dataclasses.fields(Hardware):
        value = fields.get(field.name, field.default)
        if field.name == "name":
            ok = isinstance(value, str)
        elif field.name == "reduce_scatter_as_all_reduce":
            ok = isinstance(value, bool)
        elif field.name in ("gpus_per_node", "nics_per_node"):
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= (field.name == "gpus_per_node")
        elif field.name in ("matmul_efficiency", "overlap", "fp8_matmul_efficiency", "attention_efficiency"):
            ok = _number(value) and 0 <= value <= 1 and (field.name != "matmul_efficiency" or value > 0)
        elif field.name in ("reserved_bytes", "latency_s", "op_overhead_s", "subclass_op_overhead_s", "fp8_peak_flops"):
            ok = _number(value) and value >= 0
        else:
            ok = _number(value) and value > 0
        if not ok:
            raise InputFileError(
                f"{key} = '{path}': field {field.name} = {value!r} is out of range or of the wrong type."
            )


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
