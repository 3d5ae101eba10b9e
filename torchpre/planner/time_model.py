"""Step time of a layout from counted work and a `Hardware` profile: plain arithmetic, no torch.

The model, per pipeline rank (all of its stage chunks together), for one step of m microbatches:
- compute per microbatch = flops / (peak_flops x matmul_efficiency) + MEMORY_TRAFFIC x other_bytes / mem_bw
  + ops x op_overhead_s + subclass_ops x subclass_op_overhead_s (DTensor's Python dispatch under TP). `flops` are
  the matmul and attention FLOPs a `FlopCounterMode` counts (recompute included), of which `fp8_flops` (torchao's
  FP8 matmuls under quantize.linear) run at fp8_peak_flops x fp8_matmul_efficiency instead and `attention_flops`
  (flash attention) at peak_flops x attention_efficiency; under compile.enable the memory-bound term is
  `COMPILE_ELEMENTWISE` of the eager one plus torchao's fused casts (`compute_seconds`). Everything else (norms,
  activations, adds, copies) is memory-bound: it moves MEMORY_TRAFFIC = 2.5 bytes per byte it writes (about half
  of a block's elementwise ops are unary: read 1, write 1; half binary, as most of backward's grad x saved
  products: read 2, write 1). `mem_bw` is read + write traffic, as datasheets and
  `torchpre.planner.calibrate` state it.
- CP (context parallelism): every attention layer all-gathers its keys and values over cp in forward (again in a
  full-AC backward's recompute) and reduce-scatters their gradients in backward; the probe counts them as it counts
  TP's (`torchpre.planner.stage_costs.to_work` tells the dimensions apart by their groups' rank stride).
- EP (expert parallelism): every MoE layer all-to-alls its routed rows to their experts' ranks and back in forward
  (dispatch and combine: tokens x top-k x dim in the compute dtype each, after an exchange of the per-expert row
  counts) and their gradients both ways in backward, as the probe counts them for a balanced router. The experts'
  gradients are reduced, and their parameters gathered, over edp (the dp x cp / ep ranks that hold the same
  experts: `RankWork.expert_grad_bytes`), the other parameters' over dp.
- The network as NCCL uses it (`group_seconds`): a group within one node runs a ring over NVLink,
  t = steps x latency_s + f x bytes / intra_node_bw (`collective_seconds`). A group that spans nodes with k of its
  ranks on each node moves the same f x bytes through every node, split over the NICs of those k ranks (NCCL runs a
  channel per NIC; on a rail-optimised fabric a device's NIC is on its own rail), so bw = min(intra_node_bw, k x
  the NIC bandwidth per device): a data-parallel group of all 8 ranks of each node gets the node's 8 NICs, one of
  tensor-parallel stride 8 gets one NIC per node. Latency is hierarchical: (k - 1) steps within the node and
  (nodes - 1) between them for a ring's all-gather and reduce-scatter, twice (k - 1) + log2(nodes) for the
  all-reduce, which NCCL runs as a tree across nodes. An all-to-all sends (n - k) / n of its buffer off the node
  over each rank's own NIC share; a pipeline send between nodes one device's NIC share.
- TP, EP and CP collectives run inside the microbatch and are exposed (no async TP), each over its group as the
  mesh's order places it (within a node, or across nodes with k ranks per node).
- PP: every stage chunk sends its boundary activation forward and receives its gradient back per microbatch:
  2 v m sends of `boundary_bytes`.
- The pipeline runs for (m x t_mb + pp_comm) / (1 - bubble) with the slowest rank's t_mb (the schedule table's
  bubble fraction, equal stage times assumed); a faster rank idles the difference, counted as its bubble.
- DP (`dp_seconds`): ZeRO 0 all-reduces the gradients once; 1 reduce-scatters them once and all-gathers the
  parameters after the step; 2 reduce-scatters every microbatch and all-gathers after the step; 3 (FSDP2)
  all-gathers the parameters in forward and again in backward (once, without resharding after forward) and
  reduce-scatters the gradients, every microbatch. Gradient reductions overlap backward (ZeRO 3: the whole
  microbatch) up to `overlap`; the last bucket never does (it is launched when backward ends): exposed =
  max(last bucket, comm - overlap x window). Post-step all-gathers are exposed. Under pipelining ZeRO 3 is different:
  the schedule turns FSDP2's gradient sync and resharding after backward off until the last microbatch, so it
  gathers the parameters once per step (once per microbatch more when it reshards after forward, in backward) and
  reduce-scatters once, after the last backward, exposed (the first stage's last backward ends the pipeline); its
  gathers hide behind the first microbatch's forward up to `overlap`. ZeRO 3's all-gathers and reduce-scatters are
  priced as one collective of the rank's parameters each; with FSDP2 units per sub-layer
  (`fsdp_units_per_block` = 3: a block's norms, attention and feed-forward) each is that many collectives of a
  third of the bytes: the same bandwidth term, three times the latency terms.
- Optimizer: AdamW reads the fp32 master, gradient, exp_avg and exp_avg_sq (16 B/param) and writes master,
  exp_avg, exp_avg_sq (12 B/param): 28 B per 8 B of state, so OPTIMIZER_TRAFFIC = 3.5 x state bytes / mem_bw,
  plus its ops x op_overhead_s.

Mesh: row-major (pp, dp, cp, tp), with dp x cp split into (edp, ep) under expert parallelism (`parallel_dims`): tp
has stride 1, cp stride tp, ep stride tp, dp stride tp (its gradient reduction spans dp x cp ranks), edp stride
ep x tp, pp stride dp x cp x tp.
"""

import functools
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

from torchpre.planner.allocator import FRAGMENTATION
from torchpre.planner.hardware import Hardware
from torchpre.step_rules.schedules import get_schedule
from torchpre.step_rules.zero_stages import zero_stage

Op = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send"]
Dim = Literal["tp", "ep", "cp", "dp", "edp", "pp"]

DEFAULT_BUCKET_BYTES = 25 * 2**20  # torchpre.distributed.collectives.DEFAULT_BUCKET_BYTES (that module loads torch)
MICROBATCH_DIMS: tuple[Dim, ...] = ("tp", "ep", "cp")  # whose collectives run, exposed, inside each microbatch
OPTIMIZER_TRAFFIC = 3.5  # bytes AdamW moves per byte of its state (see the module docstring)
MEMORY_TRAFFIC = 2.5  # bytes a memory-bound op moves per byte it writes (see the module docstring)
# The share of eager elementwise traffic and op launches a torch.compile'd step still pays. Calibrated (one number
# for every layout, with the h100-96gb-hbm2e-500w row's efficiencies) against torchtitan's Llama 3.1 8B rows, eager
# and compiled (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md): bench/plan_vs_published.py.
COMPILE_ELEMENTWISE = 0.4
# Bytes a compiled torchao tensorwise cast moves per FP8 operand element: its amax pass reads the bf16 value (2),
# the scaled cast reads it again (2) and writes one FP8 byte (1). (An eager cast runs the chain unfused: the
# probe counts 13-18 bytes written per element for Llama 3.1 8B's blocks.)
FUSED_FP8_CAST_BYTES = 5.0


@dataclass(frozen=True)
class Collective:
    """One collective over a mesh dimension, run `count` times. `bytes` is the full buffer: an all-reduce's tensor,
    an all-gather's output, a reduce-scatter's input, an all-to-all's send buffer, a send's tensor. A stage of n
    blocks runs each of a block's collectives n times: one entry with count n, timed once."""

    op: Op
    dim: Dim
    bytes: float
    count: int = 1


@dataclass(frozen=True)
class Work:
    """A forward or a backward of one microbatch through all of a rank's stage chunks.

    flops: matmul and attention FLOPs (recompute included in the backward). other_bytes: bytes written by every
    other op. ops: eager ops dispatched. collectives: the TP/EP collectives it runs (group size from the dim).
    fp8_flops: the part of `flops` done by FP8 matmuls. attention_flops: the part done by attention kernels (flash
    attention reaches a smaller fraction of peak than a large matmul: `Hardware.attention_efficiency`).
    """

    flops: float
    other_bytes: float = 0.0
    ops: int = 0
    collectives: tuple[Collective, ...] = ()
    subclass_ops: int = 0
    fp8_flops: float = 0.0
    attention_flops: float = 0.0
    fp8_cast_elements: float = 0.0

    def __add__(self, other: "Work") -> "Work":
        """Both, one after the other: how a rank's stage chunks (or a probe's parts) add up."""
        return Work(self.flops + other.flops, self.other_bytes + other.other_bytes, self.ops + other.ops,
                    self.collectives + other.collectives, self.subclass_ops + other.subclass_ops,
                    self.fp8_flops + other.fp8_flops, self.attention_flops + other.attention_flops,
                    self.fp8_cast_elements + other.fp8_cast_elements)


@dataclass(frozen=True)
class RankWork:
    """What one pipeline rank does per step.

    forward, backward: per microbatch. boundary_bytes: activation bytes one stage chunk sends to the next per
    microbatch (its gradient comes back the same size). grad_bytes: the rank's full (not DP-sharded) gradients in
    the reduction dtype; param_bytes: its full parameters in the all-gather dtype; expert_*: the same for experts
    under expert parallelism (reduced over edp instead of dp). optimizer_state_bytes: the state this rank keeps
    (sharded under ZeRO >= 1); optimizer_ops: eager ops of one optimizer step.
    """

    forward: Work
    backward: Work
    boundary_bytes: float = 0.0
    grad_bytes: float = 0.0
    param_bytes: float = 0.0
    expert_grad_bytes: float = 0.0
    expert_param_bytes: float = 0.0
    optimizer_state_bytes: float = 0.0
    optimizer_ops: int = 0


@dataclass(frozen=True)
class TimeLayout:
    """The parallel layout: degrees, microbatches per step, the schedule and its stages per rank, the ZeRO stage."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    microbatches: int = 1
    schedule: str = "1F1B"
    stages_per_rank: int = 1
    zero_stage: int = 0
    bucket_bytes: float = DEFAULT_BUCKET_BYTES
    compiled: bool = False  # compile.enable: blocks' elementwise ops fused (`COMPILE_ELEMENTWISE`)
    reshard_after_forward: bool = True  # ZeRO 3: FSDP2 frees the gathered parameters after forward, gathers again
    fsdp_units_per_block: int = 1  # ZeRO 3: FSDP2 units per block, 3 under parallelism.fsdp_wrap = "sublayer"

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    def group(self, dim: Dim) -> tuple[int, int]:
        """(size, stride) of `dim`'s groups in the row-major mesh; the cp ranks of a sequence reduce its gradients
        with the dp ranks (`dp` spans dp x cp)."""
        reducing = self.dp * self.cp
        return {
            "tp": (self.tp, 1),
            "cp": (self.cp, self.tp),
            "ep": (self.ep, self.tp),
            "dp": (reducing, self.tp),
            "edp": (reducing // self.ep, self.ep * self.tp),
            "pp": (self.pp, reducing * self.tp),
        }[dim]


@dataclass(frozen=True)
class StepTime:
    """One rank's step, seconds. total_s = compute_s + tp_comm_s + ep_comm_s + cp_comm_s + pp_comm_s + bubble_s +
    dp_comm_exposed_s + optimizer_s; dp_comm_s is all DP communication, hidden or not."""

    compute_s: float
    tp_comm_s: float
    ep_comm_s: float
    pp_comm_s: float
    dp_comm_s: float
    dp_comm_exposed_s: float
    bubble_s: float
    optimizer_s: float
    cp_comm_s: float = 0.0
    total_s: float = field(init=False)

    def __post_init__(self) -> None:
        parts = (self.compute_s, self.tp_comm_s, self.ep_comm_s, self.cp_comm_s, self.pp_comm_s, self.bubble_s,
                 self.dp_comm_exposed_s, self.optimizer_s)
        object.__setattr__(self, "total_s", sum(parts))

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def assumptions(hardware: Hardware) -> dict[str, float | bool | str]:
    """The model's stated assumptions for this hardware, for every printed breakdown: what a reader must accept."""
    return {
        "hardware": hardware.name,
        "matmul_efficiency": hardware.matmul_efficiency,
        "fp8_matmul_efficiency": hardware.fp8_matmul_efficiency or hardware.matmul_efficiency,
        "attention_efficiency": hardware.attention_efficiency or hardware.matmul_efficiency,
        "compile_elementwise": COMPILE_ELEMENTWISE,
        "fused_fp8_cast_bytes": FUSED_FP8_CAST_BYTES,
        "allocator_reserved_per_tensor_byte": 1 + FRAGMENTATION,
        "overlap": hardware.overlap,
        "op_overhead_s": hardware.op_overhead_s,
        "latency_s": hardware.latency_s,
        "reduce_scatter_as_all_reduce": hardware.reduce_scatter_as_all_reduce,
        "memory_traffic_per_written_byte": MEMORY_TRAFFIC,
        "optimizer_traffic_per_state_byte": OPTIMIZER_TRAFFIC,
        "equal_stage_times_in_bubble": True,
    }


def intra_node(layout: TimeLayout, dim: Dim, gpus_per_node: int) -> bool:
    """Whether every group of `dim` lies within one node (ranks r and r' share a node iff r // g == r' // g)."""
    return _groups_within_nodes(*layout.group(dim), layout.world_size, gpus_per_node)


@functools.cache
def _groups_within_nodes(size: int, stride: int, world_size: int, gpus_per_node: int) -> bool:
    """`intra_node` for groups of `size` ranks `stride` apart in a row-major world: cached on what it depends on,
    not on the layout (a search asks it for thousands of layouts and a few distinct groups)."""
    span = (size - 1) * stride
    starts = (rank for rank in range(world_size) if (rank // stride) % size == 0)
    return all(rank // gpus_per_node == (rank + span) // gpus_per_node for rank in starts)


def collective_seconds(op: Op, n: int, nbytes: float, bw: float, hardware: Hardware) -> float:
    """Ring model: steps x latency + f x bytes / bw; all-reduce 2(n-1) steps, f = 2(n-1)/n; all-gather,
    reduce-scatter, all-to-all n-1 steps, f = (n-1)/n; a send 1 step, f = 1. A reduce-scatter costs an all-reduce
    where the backend runs it as one (`Hardware.reduce_scatter_as_all_reduce`)."""
    if op == "send":
        return hardware.latency_s + nbytes / bw
    if n == 1:
        return 0.0
    if op == "all_reduce" or (op == "reduce_scatter" and hardware.reduce_scatter_as_all_reduce):
        return 2 * (n - 1) * hardware.latency_s + 2 * (n - 1) / n * nbytes / bw
    return (n - 1) * hardware.latency_s + (n - 1) / n * nbytes / bw


@functools.cache
def ranks_per_node(size: int, stride: int, world_size: int, gpus_per_node: int) -> int:
    """The fewest ranks of a group of `size` ranks `stride` apart (row-major world) that share a node, over every
    group and node: the NICs its inter-node bytes leave the busiest node by. `size` when the groups lie within
    nodes."""
    fewest = size
    for start in range(world_size):
        if (start // stride) % size == 0:
            nodes = Counter((start + i * stride) // gpus_per_node for i in range(size))
            fewest = min(fewest, *nodes.values())
    return fewest


def group_seconds(op: Op, n: int, per_node: int, nbytes: float, hardware: Hardware) -> float:
    """One collective over a group of `n` ranks with `per_node` of them on each node it spans (`n` within one
    node), as NCCL runs it (see the module docstring)."""
    if per_node >= n:
        return collective_seconds(op, n, nbytes, hardware.intra_node_bw, hardware)
    nodes, nic, latency = math.ceil(n / per_node), hardware.nic_bw_per_device, hardware.latency_s
    if op == "send":
        return latency + nbytes / nic
    if op == "all_to_all":
        off_node = (n - per_node) / n * nbytes / nic
        return (n - 1) * latency + max(off_node, (per_node - 1) / n * nbytes / hardware.intra_node_bw)
    bw = min(hardware.intra_node_bw, per_node * nic)
    if op == "all_reduce" or (op == "reduce_scatter" and hardware.reduce_scatter_as_all_reduce):
        return 2 * (per_node - 1 + math.ceil(math.log2(nodes))) * latency + 2 * (n - 1) / n * nbytes / bw
    return (per_node - 1 + nodes - 1) * latency + (n - 1) / n * nbytes / bw


def collective_on(collective: Collective, layout: TimeLayout, hardware: Hardware) -> float:
    """`group_seconds` over the groups of its mesh dimension, as the mesh's order places them on nodes, `count`
    times; nothing to move is free. A pipeline send goes between two neighbouring stages: across nodes when the
    pp groups span them."""
    size, stride = layout.group(collective.dim)
    if size == 1 or collective.bytes == 0:
        return 0.0
    per_node = ranks_per_node(size, stride, layout.world_size, hardware.gpus_per_node)
    if collective.op == "send":
        size, per_node = 2, 2 if per_node >= size else 1
    return collective.count * group_seconds(collective.op, size, per_node, collective.bytes, hardware)


def compute_seconds(work: Work, hardware: Hardware, compiled: bool = False) -> float:
    """The work's matmul FLOPs at the matmul rate (FP8 ones at the FP8 rate), its attention FLOPs at the attention
    rate, its other ops' memory traffic at memory bandwidth, and every op's overhead. `compiled`: torch.compile
    fuses the elementwise ops into few kernels, which keep `COMPILE_ELEMENTWISE` of the eager traffic and launches,
    and torchao's FP8 casts into kernels moving `FUSED_FP8_CAST_BYTES` per FP8 operand element."""
    fp8_peak = hardware.fp8_peak_flops or hardware.peak_flops  # no FP8 tensor cores: emulated at the high rate
    fp8_efficiency = hardware.fp8_matmul_efficiency or hardware.matmul_efficiency
    attention_efficiency = hardware.attention_efficiency or hardware.matmul_efficiency
    elementwise = MEMORY_TRAFFIC * work.other_bytes / hardware.mem_bw + work.ops * hardware.op_overhead_s
    if compiled:
        casts = FUSED_FP8_CAST_BYTES * work.fp8_cast_elements / hardware.mem_bw
        elementwise = COMPILE_ELEMENTWISE * elementwise + casts
    bf16_matmul = work.flops - work.fp8_flops - work.attention_flops
    return (
        bf16_matmul / (hardware.peak_flops * hardware.matmul_efficiency)
        + work.fp8_flops / (fp8_peak * fp8_efficiency)
        + work.attention_flops / (hardware.peak_flops * attention_efficiency)
        + elementwise
        + work.subclass_ops * hardware.subclass_op_overhead_s
    )


def comm_seconds(work: Work, dim: Dim, layout: TimeLayout, hardware: Hardware) -> float:
    return sum(collective_on(c, layout, hardware) for c in work.collectives if c.dim == dim)


def dp_seconds(rank: RankWork, layout: TimeLayout, hardware: Hardware) -> tuple[float, float]:
    """(all DP communication, the exposed part) of one step; see the module docstring."""
    forward = _microbatch_seconds(rank.forward, layout, hardware)
    backward = _microbatch_seconds(rank.backward, layout, hardware)
    windows = (forward, backward)
    dense = _dp_dim_seconds("dp", rank.grad_bytes, rank.param_bytes, windows, layout, hardware)
    expert = _dp_dim_seconds("edp", rank.expert_grad_bytes, rank.expert_param_bytes, windows, layout, hardware)
    return dense[0] + expert[0], dense[1] + expert[1]


def _dp_dim_seconds(
    dim: Dim, grads: float, params: float, windows: tuple[float, float], layout: TimeLayout, hardware: Hardware
) -> tuple[float, float]:
    """(total, exposed) DP seconds over one mesh dimension's groups, for the layout's ZeRO stage; `windows` are a
    microbatch's forward and backward seconds, which the communication may hide behind."""

    zero, m = zero_stage(layout.zero_stage), layout.microbatches
    units = layout.fsdp_units_per_block if zero.shards_parameters else 1

    def once(op: Op, nbytes: float) -> float:
        return collective_on(Collective(op, dim, nbytes), layout, hardware)

    def run(op: Op, nbytes: float) -> float:
        """`nbytes` of `op` over the step's units: FSDP2's `units` collectives per block's share under ZeRO 3."""
        return units * once(op, nbytes / units)

    forward, backward = windows
    if zero.shards_parameters and layout.pp > 1:
        return _fsdp_under_pipelining(run, once, grads, params, forward, layout, hardware)
    reduce_op: Op = "reduce_scatter" if zero.shards_optimizer_state else "all_reduce"
    reduce, last = run(reduce_op, grads), once(reduce_op, min(layout.bucket_bytes, grads))
    rounds = m if zero.shards_gradients else 1  # sharded gradients are reduced every microbatch
    window = forward + backward if zero.shards_parameters else backward
    gathers = 2 if layout.reshard_after_forward else 1
    during = reduce + (gathers * run("all_gather", params) if zero.shards_parameters else 0.0)
    # Sharded state gathers the stepped parameters once per step; sharded parameters gather per use instead.
    after = run("all_gather", params) if zero.shards_optimizer_state and not zero.shards_parameters else 0.0
    total = rounds * during + after
    exposed = rounds * max(last, during - hardware.overlap * window) + after
    return total, exposed


def _fsdp_under_pipelining(
    run: Callable[[Op, float], float],
    once: Callable[[Op, float], float],
    grads: float,
    params: float,
    forward: float,
    layout: TimeLayout,
    hardware: Hardware,
) -> tuple[float, float]:
    """(total, exposed) seconds of FSDP2 under a pipeline schedule (see the module docstring): one gather of the
    parameters per step, or one per microbatch more when they are resharded after forward, and one reduce-scatter
    of the gradients after the last backward."""
    gather = run("all_gather", params)
    gathers = (1 + layout.microbatches) * gather if layout.reshard_after_forward else gather
    reduce = run("reduce_scatter", grads)
    first = once("all_gather", min(layout.bucket_bytes, params))  # the first block's gather precedes any compute
    hidden = hardware.overlap * forward * (layout.microbatches if layout.reshard_after_forward else 1)
    return gathers + reduce, reduce + max(first, gathers - hidden)


def _microbatch_seconds(work: Work, layout: TimeLayout, hardware: Hardware) -> float:
    communication = sum(comm_seconds(work, d, layout, hardware) for d in MICROBATCH_DIMS)
    return compute_seconds(work, hardware, layout.compiled) + communication


def pp_seconds(rank: RankWork, layout: TimeLayout, hardware: Hardware) -> float:
    """2 v m sends of the boundary activation (forward) and its gradient (backward) per step."""
    if layout.pp == 1:
        return 0.0
    sends = 2 * layout.stages_per_rank * layout.microbatches
    return sends * collective_on(Collective("send", "pp", rank.boundary_bytes), layout, hardware)


def rank_step_times(layout: TimeLayout, ranks: Sequence[RankWork], hardware: Hardware) -> list[StepTime]:
    """Each pipeline rank's `StepTime` (`ranks[r]` is pp rank r), all paced by the slowest rank's microbatches."""
    if len(ranks) != layout.pp:
        raise ValueError(f"{len(ranks)} ranks of work for pp = {layout.pp}")
    bubble = get_schedule(layout.schedule).bubble(layout.pp, layout.microbatches, layout.stages_per_rank)
    distinct = list({id(rank): rank for rank in ranks}.values())  # a deep pipeline's ranks share a few RankWorks
    busy = {id(rank): _busy_seconds(rank, layout, hardware) for rank in distinct}
    pipeline = max(busy.values()) / (1 - bubble)
    times = {id(rank): _rank_step_time(rank, busy[id(rank)], pipeline, layout, hardware) for rank in distinct}
    return [times[id(rank)] for rank in ranks]


def _busy_seconds(rank: RankWork, layout: TimeLayout, hardware: Hardware) -> float:
    """The rank's microbatches and pipeline sends of one step."""
    m = layout.microbatches
    return (m * (_microbatch_seconds(rank.forward, layout, hardware) + _microbatch_seconds(rank.backward, layout,
                                                                                          hardware))
            + pp_seconds(rank, layout, hardware))  # fmt: skip


def _rank_step_time(rank: RankWork, busy: float, pipeline: float, layout: TimeLayout, hardware: Hardware) -> StepTime:
    """One rank's `StepTime`, paced by the slowest rank's `pipeline` seconds."""
    m = layout.microbatches
    dp, dp_exposed = dp_seconds(rank, layout, hardware)
    return StepTime(
        compute_s=m * sum(compute_seconds(w, hardware, layout.compiled) for w in (rank.forward, rank.backward)),
        tp_comm_s=m * sum(comm_seconds(w, "tp", layout, hardware) for w in (rank.forward, rank.backward)),
        ep_comm_s=m * sum(comm_seconds(w, "ep", layout, hardware) for w in (rank.forward, rank.backward)),
        cp_comm_s=m * sum(comm_seconds(w, "cp", layout, hardware) for w in (rank.forward, rank.backward)),
        pp_comm_s=pp_seconds(rank, layout, hardware),
        dp_comm_s=dp,
        dp_comm_exposed_s=dp_exposed,
        bubble_s=pipeline - busy,
        optimizer_s=OPTIMIZER_TRAFFIC * rank.optimizer_state_bytes / hardware.mem_bw
        + rank.optimizer_ops * hardware.op_overhead_s,
    )


def step_time(layout: TimeLayout, ranks: Sequence[RankWork], hardware: Hardware) -> StepTime:
    """The step time of the job: the slowest rank's `StepTime`."""
    return max(rank_step_times(layout, ranks, hardware), key=lambda t: t.total_s)
