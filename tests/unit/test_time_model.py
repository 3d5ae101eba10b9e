"""The step-time model against hand-computed numbers (each expected value is worked out in the comment above it).

A toy machine keeps the arithmetic readable: 1 TFLOP/s at 50% matmul efficiency (0.5e12 effective), 10 GB/s memory,
1 ms per collective step, 4 GB/s within a node of 2 ranks, one NIC of 1 GB/s per node (a group of both ranks of
each node that spans nodes gets 1 GB/s: hierarchical latency, (k - 1) + (nodes - 1) ring steps, or 2 x ((k - 1) +
log2(nodes)) for an all-reduce's tree). Tolerance: 1e-12 relative, float
rounding only; the model is closed-form.
"""

import dataclasses

import pytest

from torchpre.planner.hardware import HARDWARE, Hardware
from torchpre.planner.time_model import (
    Collective,
    RankWork,
    TimeLayout,
    Work,
    assumptions,
    collective_on,
    collective_seconds,
    compute_seconds,
    intra_node,
    rank_step_times,
    ranks_per_node,
    step_time,
)

TOY = Hardware(
    name="toy", peak_flops=1e12, memory_bytes=1e10, reserved_bytes=0, intra_node_bw=4e9, inter_node_bw=1e9,
    latency_s=1e-3, gpus_per_node=2, matmul_efficiency=0.5, mem_bw=1e10, op_overhead_s=1e-6, overlap=1.0,
    nics_per_node=1,
)
MiB = 2**20
# forward 1e11 FLOPs = 0.2 s, backward 2e11 = 0.4 s at 0.5e12 FLOP/s
PLAIN = RankWork(forward=Work(flops=1e11), backward=Work(flops=2e11))


def approx(value):
    return pytest.approx(value, rel=1e-12)


def test_one_rank_is_compute_and_optimizer():
    """h100-80gb: 989e12 x 0.59 = 583.51e12 FLOP/s, 3.35e12 B/s, 5 us per op."""
    work = RankWork(
        forward=Work(flops=2e12, other_bytes=1.34e9, ops=400),
        backward=Work(flops=4e12, other_bytes=2.01e9, ops=600),
        optimizer_state_bytes=8e9,
        optimizer_ops=1000,
    )
    time = step_time(TimeLayout(microbatches=4), [work], HARDWARE["h100-80gb"])
    # per microbatch: 6e12 / 583.51e12 + 2.5 x 3.35e9 / 3.35e12 + 1000 x 5e-6 = 0.0102826 + 0.0025 + 0.005
    assert time.compute_s == approx(4 * (6e12 / 583.51e12 + 0.0025 + 0.005))
    # AdamW: 3.5 x 8e9 / 3.35e12 + 1000 x 5e-6
    assert time.optimizer_s == approx(3.5 * 8e9 / 3.35e12 + 0.005)
    assert (time.tp_comm_s, time.pp_comm_s, time.dp_comm_s, time.bubble_s) == (0, 0, 0, 0)
    assert time.total_s == approx(time.compute_s + time.optimizer_s)
    assert set(time.as_dict()) == {"compute_s", "tp_comm_s", "ep_comm_s", "cp_comm_s", "pp_comm_s", "dp_comm_s",
                                   "dp_comm_exposed_s", "bubble_s", "optimizer_s", "total_s"}


def test_405b_layout_uses_nvlink_for_tp_only():
    """tp8 x dp8 x pp16 at 8 GPUs per node: a tp group is one node; dp (stride 8) and pp (stride 64) cross nodes."""
    layout = TimeLayout(dp=8, tp=8, pp=16, microbatches=16)
    assert intra_node(layout, "tp", 8) and not intra_node(layout, "dp", 8) and not intra_node(layout, "pp", 8)
    # tp4 x dp2: a dp group (stride 4) spans ranks r and r + 4, the same node of 8
    assert intra_node(TimeLayout(dp=2, tp=4), "dp", 8) and not intra_node(TimeLayout(dp=4, tp=4), "dp", 8)
    h100 = HARDWARE["h100-80gb"]
    tp_all_reduce = Collective("all_reduce", "tp", 64 * MiB)
    work = RankWork(forward=Work(flops=0, collectives=(tp_all_reduce,)), backward=Work(flops=0),
                    grad_bytes=1e9, boundary_bytes=1e6)
    time = rank_step_times(layout, [work] * 16, h100)[0]
    # ring all-reduce over 8 on NVLink: 2 x 7 x 10 us + 2 x 7/8 x 64 MiB / 450e9, 16 microbatches
    assert time.tp_comm_s == approx(16 * (14 * 10e-6 + 1.75 * 64 * MiB / 450e9))
    # ZeRO 0, all-reduce of 1 GB over 8 ranks one per node (dp stride 8): NCCL's tree over 8 nodes, 2 x log2(8)
    # steps of 10 us + 1.75 x 1e9 / 50e9 over each rank's own NIC (nothing to hide it behind but the last bucket's
    # own time, and the backward here is free)
    assert time.dp_comm_s == approx(6 * 10e-6 + 1.75e9 / 50e9)
    assert time.dp_comm_exposed_s == approx(time.dp_comm_s)
    # 2 x 16 sends of 1 MB on InfiniBand: 10 us + 1e6 / 50e9 each
    assert time.pp_comm_s == approx(32 * (10e-6 + 1e6 / 50e9))


def test_a_group_spanning_nodes_uses_the_nics_of_its_ranks_on_each_node():
    """h100-80gb: 8 NICs of 50 GB/s per node of 8, NVLink 450 GB/s, 10 us per step. MosaicML's 13B on 64 H100s
    shards over all 64 ranks, 8 on each node: an all-gather leaves each node over its 8 NICs (400 GB/s, below
    NVLink), where a data-parallel group of stride 8 (beside tp8) has one rank, one NIC, per node."""
    h100, nbytes = HARDWARE["h100-80gb"], 1e9
    fsdp64 = TimeLayout(dp=64)
    assert ranks_per_node(*fsdp64.group("dp"), 64, 8) == 8
    # (8 - 1) steps within a node + (8 - 1) between nodes; 63/64 of the buffer at min(450, 8 x 50) GB/s
    assert collective_on(Collective("all_gather", "dp", nbytes), fsdp64, h100) == approx(
        14 * 10e-6 + 63 / 64 * nbytes / 400e9)
    beside_tp8 = TimeLayout(dp=64, tp=8)
    assert ranks_per_node(*beside_tp8.group("dp"), 512, 8) == 1
    assert collective_on(Collective("all_gather", "dp", nbytes), beside_tp8, h100) == approx(
        63 * 10e-6 + 63 / 64 * nbytes / 50e9)
    # an all-reduce across nodes is NCCL's tree: 2 x ((8 - 1) + log2(8)) steps
    assert collective_on(Collective("all_reduce", "dp", nbytes), fsdp64, h100) == approx(
        20 * 10e-6 + 2 * 63 / 64 * nbytes / 400e9)
    # tp16 spans two nodes with 8 ranks on each: their 8 NICs; an ep16 all-to-all sends half its buffer off the
    # node over each rank's own NIC, 7/16 of it over NVLink
    tp16 = TimeLayout(tp=16)
    assert collective_on(Collective("all_gather", "tp", nbytes), tp16, h100) == approx(
        8 * 10e-6 + 15 / 16 * nbytes / 400e9)
    ep16 = TimeLayout(dp=16, ep=16)
    assert collective_on(Collective("all_to_all", "ep", nbytes), ep16, h100) == approx(
        15 * 10e-6 + 8 / 16 * nbytes / 50e9)
    # a pipeline send between nodes: one device's NIC; within a node: NVLink
    assert collective_on(Collective("send", "pp", nbytes), TimeLayout(pp=2, tp=8), h100) == approx(
        10e-6 + nbytes / 50e9)
    assert collective_on(Collective("send", "pp", nbytes), TimeLayout(pp=2, tp=4), h100) == approx(
        10e-6 + nbytes / 450e9)
    # a group placed unevenly (stride 3 on nodes of 8) is priced by its fewest ranks on a node
    assert ranks_per_node(4, 3, 12, 8) == 1


def test_dp_overlap_and_zero_stages():
    """dp4 on nodes of 2: the DP group crosses nodes (1 GB/s). m = 2, 1 GB of gradients, 0.5 GB of parameters."""
    work = RankWork(forward=PLAIN.forward, backward=PLAIN.backward, grad_bytes=1e9, param_bytes=5e8)
    bucket = 25 * MiB

    zero0 = step_time(TimeLayout(dp=4, microbatches=2, zero_stage=0), [work], TOY)
    # all-reduce: 2 x (1 + 1) x 1 ms + 2 x 3/4 x 1e9 / 1e9 = 1.504 s, once; hidden behind one backward (0.4 s)
    assert zero0.dp_comm_s == approx(1.504)
    assert zero0.dp_comm_exposed_s == approx(1.504 - 0.4)
    assert zero0.total_s == approx(2 * 0.6 + 1.104)

    zero1 = step_time(TimeLayout(dp=4, microbatches=2, zero_stage=1), [work], TOY)
    # reduce-scatter 2 ms + 0.75 s = 0.752 s (exposed 0.352 s), then the parameters' all-gather 2 ms + 0.375 s
    assert zero1.dp_comm_s == approx(0.752 + 0.377)
    assert zero1.dp_comm_exposed_s == approx(0.352 + 0.377)

    zero2 = step_time(TimeLayout(dp=4, microbatches=2, zero_stage=2), [work], TOY)
    # one reduce-scatter per microbatch, each behind its backward, then the all-gather
    assert zero2.dp_comm_exposed_s == approx(2 * 0.352 + 0.377)

    zero3 = step_time(TimeLayout(dp=4, microbatches=2, zero_stage=3), [work], TOY)
    # per microbatch: reduce-scatter 0.752 + 2 all-gathers 0.754 = 1.506 s behind the whole microbatch (0.6 s)
    assert zero3.dp_comm_s == approx(2 * 1.506)
    assert zero3.dp_comm_exposed_s == approx(2 * (1.506 - 0.6))

    # a small gradient hides entirely, except its last (here: only) bucket: 2 ms + 0.75 x 1e6 / 1e9
    small = RankWork(forward=PLAIN.forward, backward=PLAIN.backward, grad_bytes=1e6)
    assert step_time(TimeLayout(dp=4, zero_stage=1), [small], TOY).dp_comm_exposed_s == approx(0.002 + 0.00075)
    # a large one: the last bucket is 25 MiB
    big = step_time(TimeLayout(dp=4, zero_stage=1), [RankWork(Work(0), Work(0), grad_bytes=1e9)], TOY)
    assert big.dp_comm_exposed_s == approx(0.752)  # nothing to hide behind
    no_overlap = Hardware(**{**TOY.__dict__, "overlap": 0.0})
    assert step_time(TimeLayout(dp=4, microbatches=2), [work], no_overlap).dp_comm_exposed_s == approx(1.504)
    gloo = Hardware(**{**TOY.__dict__, "reduce_scatter_as_all_reduce": True})
    assert step_time(TimeLayout(dp=4, zero_stage=1), [work], gloo).dp_comm_s == approx(1.504 + 0.377)
    assert collective_seconds("reduce_scatter", 4, bucket, 1e9, TOY) == approx(0.003 + 0.75 * bucket / 1e9)


def test_zero3_units_per_sublayer_cost_three_collectives_a_block():
    """parallelism.fsdp_wrap = "sublayer": a block's norms, attention and feed-forward are gathered and reduced one
    by one, so each of ZeRO-3's collectives is three of a third the size: the same bytes, three times the latency
    (dp4 on nodes of 2: 2 steps of 1 ms). Per microbatch: reduce-scatter 6 ms + 0.75 s, 2 all-gathers of
    6 ms + 0.375 s."""
    work = RankWork(forward=PLAIN.forward, backward=PLAIN.backward, grad_bytes=1e9, param_bytes=5e8)
    block = step_time(TimeLayout(dp=4, microbatches=2, zero_stage=3), [work], TOY)
    sublayer = step_time(TimeLayout(dp=4, microbatches=2, zero_stage=3, fsdp_units_per_block=3), [work], TOY)
    assert block.dp_comm_s == approx(2 * 1.506)
    assert sublayer.dp_comm_s == approx(2 * (0.756 + 2 * 0.381))
    # ZeRO-1 has no FSDP units: the key changes nothing there
    zero1 = TimeLayout(dp=4, microbatches=2, zero_stage=1)
    assert step_time(dataclasses.replace(zero1, fsdp_units_per_block=3), [work], TOY) == step_time(zero1, [work], TOY)


def test_zero3_under_pipelining_gathers_and_reduces_once_per_step():
    """FSDP2 under a pipeline schedule: sync and resharding after backward are off until the last microbatch, so
    dp4 x pp2 with 4 microbatches gathers the parameters once (2 ms + 0.375 s) and reduce-scatters once (0.752 s),
    where it once charged two gathers and a reduce-scatter per microbatch (4 x 1.506 s). The reduce-scatter follows
    the last backward, exposed; the gather hides behind the first forward (0.2 s) but for its first bucket."""
    work = RankWork(forward=PLAIN.forward, backward=PLAIN.backward, grad_bytes=1e9, param_bytes=5e8)
    layout = TimeLayout(dp=4, pp=2, microbatches=4, zero_stage=3, reshard_after_forward=False)
    time = rank_step_times(layout, [work, work], TOY)[0]
    assert time.dp_comm_s == approx(0.377 + 0.752)
    assert time.dp_comm_exposed_s == approx(0.752 + 0.377 - 0.2)
    # resharded after forward (parallelism.fsdp_reshard_after_forward = 'always'): a gather in every backward too
    resharded = rank_step_times(dataclasses.replace(layout, reshard_after_forward=True), [work, work], TOY)[0]
    assert resharded.dp_comm_s == approx(5 * 0.377 + 0.752)
    assert resharded.dp_comm_exposed_s == approx(0.752 + 5 * 0.377 - 4 * 0.2)
    # ZeRO-1 on the same layout: one reduce-scatter behind a backward and the all-gather after the step
    zero1 = rank_step_times(dataclasses.replace(layout, zero_stage=1), [work, work], TOY)[0]
    assert zero1.dp_comm_s == approx(0.752 + 0.377)


def test_pipeline_bubble_paces_every_rank_by_the_slowest():
    """pp4 on nodes of 2 (inter-node sends over a device's share of the NIC, 0.5 GB/s), 1F1B, m = 8: bubble 3/11.
    Rank 3 also computes a 0.3 s forward."""
    slow = RankWork(forward=Work(flops=1.5e11), backward=PLAIN.backward, boundary_bytes=1e6)
    fast = RankWork(forward=PLAIN.forward, backward=PLAIN.backward, boundary_bytes=1e6, optimizer_state_bytes=1e9)
    layout = TimeLayout(pp=4, microbatches=8, schedule="1F1B")
    times = rank_step_times(layout, [fast, fast, fast, slow], TOY)
    # sends: 2 x 8 of (1 ms + 1e6 / 0.5e9) = 0.048 s; busy: 8 x 0.6 + 0.048 (fast), 8 x 0.7 + 0.048 (slow)
    pipeline = (8 * 0.7 + 0.048) / (1 - 3 / 11)
    assert times[3].bubble_s == approx(pipeline - 5.648)
    assert times[0].bubble_s == approx(pipeline - 4.848)
    assert times[0].pp_comm_s == approx(0.048)
    # every rank spans the same pipeline; rank 0 adds its optimizer step (3.5 x 1e9 / 1e10 = 0.35 s)
    assert times[3].total_s == approx(pipeline)
    assert times[0].total_s == approx(pipeline + 0.35)
    assert step_time(layout, [fast, fast, fast, slow], TOY) == times[0]
    # interleaved, 2 stages per rank: bubble 3/19 and twice the sends
    interleaved = rank_step_times(TimeLayout(pp=4, microbatches=8, schedule="Interleaved1F1B", stages_per_rank=2),
                                  [fast, fast, fast, slow], TOY)
    assert interleaved[3].total_s == approx((8 * 0.7 + 0.096) / (1 - 3 / 19))


def test_tp_and_ep_collectives_are_exposed_inside_each_microbatch():
    """tp2 x dp2 with ep2 on nodes of 2: tp within a node (4 GB/s), ep (stride tp = 2) across nodes, one rank per
    node, each sending over its share of the node's NIC (0.5 GB/s)."""
    layout = TimeLayout(dp=2, tp=2, ep=2, microbatches=2)
    forward = Work(flops=1e11, collectives=(Collective("all_reduce", "tp", 1e8),) * 2
                   + (Collective("all_to_all", "ep", 1e8),))
    backward = Work(flops=2e11, collectives=(Collective("all_reduce", "tp", 1e8),) * 2)
    time = step_time(layout, [RankWork(forward, backward)], TOY)
    # all-reduce over 2 within the node: 2 x 1 ms + 1 x 1e8 / 4e9 = 0.027 s, 4 per microbatch
    assert time.tp_comm_s == approx(2 * 4 * 0.027)
    # all-to-all over 2 across nodes: 1 ms + 1/2 x 1e8 / 0.5e9 = 0.101 s, 1 per microbatch
    assert time.ep_comm_s == approx(2 * 0.101)
    assert time.total_s == approx(2 * (0.6 + 4 * 0.027 + 0.101))


def test_a_collective_counted_n_times_costs_n_of_them():
    """A stage of n blocks carries each of a block's collectives once with count n (`Collective.count`), not n
    entries: it costs what n entries cost. tp2 within a node, all-reduce of 1e8 bytes = 0.027 s (above)."""
    layout = TimeLayout(dp=2, tp=2, microbatches=1)
    repeated = Work(flops=0.0, collectives=(Collective("all_reduce", "tp", 1e8),) * 126)
    counted = Work(flops=0.0, collectives=(Collective("all_reduce", "tp", 1e8, count=126),))
    times = [step_time(layout, [RankWork(work, Work(0.0))], TOY).tp_comm_s for work in (repeated, counted)]
    assert times == [approx(126 * 0.027)] * 2


def test_a_ranks_chunks_add_up():
    tp = Collective("all_reduce", "tp", 1e6)
    total = Work(1e9, 2e6, 10, (tp,)) + Work(3e9, 1e6, 5, (tp, tp))
    assert total == Work(4e9, 3e6, 15, (tp, tp, tp))
    assert sum((Work(1.0), Work(2.0)), Work(0.0)) == Work(3.0)


def test_work_for_the_wrong_number_of_ranks_is_refused():
    with pytest.raises(ValueError, match="1 ranks of work for pp = 2"):
        step_time(TimeLayout(pp=2, microbatches=2), [PLAIN], TOY)


def test_the_assumptions_name_the_efficiencies_a_reader_must_accept():
    stated = assumptions(HARDWARE["a100-80gb"])
    assert stated["hardware"] == "a100-80gb"
    assert (stated["matmul_efficiency"], stated["attention_efficiency"], stated["overlap"]) == (0.61, 0.325, 1.0)
    assert (stated["memory_traffic_per_written_byte"], stated["optimizer_traffic_per_state_byte"]) == (2.5, 3.5)


def test_attention_fp8_and_compiled_work_run_at_their_own_rates():
    """On the published platform's row: 6e11 bf16 matmul FLOPs at 59% of 989 TFLOP/s, 2e11 FP8 ones at 59% of 1979,
    2e11 attention FLOPs at 21% of 989; 1 GB written by other ops (2.5 GB moved) and 100 ops at 5 us. Compiled, the
    elementwise part is 0.4 of that plus 5 bytes per FP8 operand element at 2.4 TB/s."""
    row = HARDWARE["h100-96gb-hbm2e-500w"]
    work = Work(1e12, other_bytes=1e9, ops=100, fp8_flops=2e11, attention_flops=2e11, fp8_cast_elements=1e8)
    matmuls = 6e11 / (989e12 * 0.58) + 2e11 / (1979e12 * 0.58) + 2e11 / (989e12 * 0.21)
    elementwise = 2.5e9 / 2.4e12 + 100 * 5e-6
    assert compute_seconds(work, row) == pytest.approx(matmuls + elementwise)
    assert compute_seconds(work, row, compiled=True) == pytest.approx(matmuls + 0.4 * elementwise + 5e8 / 2.4e12)
    assert assumptions(row)["attention_efficiency"] == 0.21 and assumptions(row)["fp8_matmul_efficiency"] == 0.58


def test_a_compiled_layout_is_timed_compiled():
    """`TimeLayout.compiled` reaches every microbatch's compute (and nothing else)."""
    work = RankWork(forward=Work(1e12, other_bytes=1e10, ops=1000), backward=Work(2e12, other_bytes=2e10, ops=2000))
    row = HARDWARE["h100-96gb-hbm2e-500w"]
    eager, compiled = (step_time(TimeLayout(microbatches=2, compiled=c), [work], row) for c in (False, True))
    saved = 2 * 0.6 * (2.5 * 3e10 / 2.4e12 + 3000 * 5e-6)
    assert eager.total_s - compiled.total_s == pytest.approx(saved)
