"""The schedule table's closed forms against torch's own action order.

`in_flight_microbatches` (what the planner reads for activation memory) is checked against a walk over the
`pipeline_order` torch builds in each schedule's `__init__`, from stage objects that carry only the attributes
`__init__` reads: no process group, no model. The walk counts a forward (F) as +1 held chunk of activations and a
full backward (B) or an input backward (I, zero-bubble schedules) as -1; a weight backward (W) frees nothing counted.
An overlapped forward-backward (DualPipeV) runs its sub-actions in order, so they count in order. Every row at
p in {2, 3, 4}, m in {1, 2, 3, 4, 6, 8} (v in {2, 3} for the looped multi-stage ones), where torchpre accepts m.
"""

from types import SimpleNamespace

import pytest
import torch
from torch.distributed.pipelining import schedules as torch_schedules

from bench.pipeline_bubble import theory as bench_theory
from torchpre.errors import ConfigError
from torchpre.parallel.pipeline import check_microbatches
from torchpre.planner.schedule_walk import held_peak
from torchpre.step_rules.schedules import SCHEDULES, get_schedule

FREES = (torch_schedules.FULL_BACKWARD, torch_schedules.BACKWARD_INPUT)


def _stages_per_rank(name: str, virtual: int) -> int:
    row = get_schedule(name)
    return row.stages_per_rank(virtual if row.multi_stage else 1)


def _torch_order(name: str, pp: int, microbatches: int, per_rank: int) -> dict[int, list]:
    """torch's `pipeline_order` for `name`, built from stand-in stages of rank 0."""
    num_stages = pp * per_rank
    stages = [
        SimpleNamespace(
            num_stages=num_stages, group_size=pp, group_rank=0, stage_index=index, is_first=index == 0,
            is_last=index == num_stages - 1, submod=torch.nn.Module(),
        )
        for index in get_schedule(name).stage_ids(0, pp, per_rank)
    ]
    row = get_schedule(name)
    schedule_class = getattr(torch_schedules, row.torch_class)
    schedule = schedule_class(stages if row.multi_stage else stages[0], microbatches, loss_fn=lambda out, target: out)
    return schedule.pipeline_order


def _walk_in_flight(actions: list) -> int:
    held = peak = 0
    for action in actions:
        if action is None:
            continue
        for step in action.sub_actions or (action,):
            held += (step.computation_type == torch_schedules.FORWARD) - (step.computation_type in FREES)
            peak = max(peak, held)
    return peak


CASES = [
    pytest.param(row.name, pp, microbatches, virtual, id=f"{row.name}-p{pp}-m{microbatches}-v{virtual}")
    for row in SCHEDULES
    for virtual in ((2, 3) if row.multi_stage and row.placement == "loop" else (1,))
    for pp in (2, 3, 4)
    for microbatches in (1, 2, 3, 4, 6, 8)
]


@pytest.mark.parametrize("name, pp, microbatches, virtual", CASES)
def test_in_flight_closed_form_matches_torch_action_order(name, pp, microbatches, virtual):
    per_rank = _stages_per_rank(name, virtual)
    try:
        check_microbatches(get_schedule(name), microbatches, pp, pp * per_rank)
    except ConfigError:
        pytest.skip("torchpre does not run this schedule with these microbatches")
    order = _torch_order(name, pp, microbatches, per_rank)
    walked = [_walk_in_flight(order[rank]) for rank in range(pp)]
    closed = [get_schedule(name).in_flight_microbatches(pp, microbatches, rank, per_rank) for rank in range(pp)]
    assert closed == walked


def test_the_walk_counts_what_the_schedules_are_known_to_hold():
    """Anchors for the walk itself: GPipe holds every microbatch, 1F1B p - r, LoopedBFS every chunk."""
    assert [_walk_in_flight(a) for a in _torch_order("GPipe", 4, 8, 1).values()] == [8, 8, 8, 8]
    assert [_walk_in_flight(a) for a in _torch_order("1F1B", 4, 8, 1).values()] == [4, 3, 2, 1]
    assert [_walk_in_flight(a) for a in _torch_order("LoopedBFS", 2, 4, 3).values()] == [12, 12]


def _old_bench_theory(schedule: str, pp: int, microbatches: int) -> float:
    """bench/pipeline_bubble.py's `theory` before it moved into the table, verbatim."""
    p, m, v = pp, microbatches, {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2, "ZBVZeroBubble": 2}[schedule]
    if schedule == "ZBVZeroBubble":
        return (p - 1) / (6 * m + p - 1)
    return (p - 1) / (v * m + p - 1)


@pytest.mark.parametrize("name", ["GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"])
def test_bubble_values_are_the_old_bench_theory(name):
    per_rank = _stages_per_rank(name, 2)
    for pp in (2, 4, 8):
        for microbatches in (1, 4, 8, 32):
            old = _old_bench_theory(name, pp, microbatches)
            assert get_schedule(name).bubble(pp, microbatches, per_rank) == old
            assert bench_theory(name, pp, microbatches) == old


def test_bubble_hand_values():
    assert get_schedule("1F1B").bubble(4, 8, 1) == pytest.approx(3 / 11)
    assert get_schedule("Interleaved1F1B").bubble(4, 8, 2) == pytest.approx(3 / 19)
    assert get_schedule("InterleavedZeroBubble").bubble(4, 8, 2) == pytest.approx(3 / 51)
    assert get_schedule("AFAB").bubble(1, 8, 1) == 0.0


def test_wrong_stage_counts_and_ranks_are_refused():
    with pytest.raises(ValueError, match="1 stages per rank"):
        get_schedule("1F1B").bubble(2, 4, 2)
    with pytest.raises(ValueError, match="2 stages per rank"):
        get_schedule("ZBVZeroBubble").in_flight_microbatches(2, 4, 0, 1)
    with pytest.raises(ValueError, match="pipeline rank 2"):
        get_schedule("GPipe").in_flight_microbatches(2, 4, 2)


@pytest.mark.parametrize("name, pp, microbatches, virtual", CASES)
def test_the_walk_of_chunks_of_one_size_holds_the_closed_form_count(name, pp, microbatches, virtual):
    """`held_peak` (what the planner and the dry run hold, chunk by chunk) with every chunk one unit: the table's
    count on every rank."""
    per_rank = _stages_per_rank(name, virtual)
    try:
        check_microbatches(get_schedule(name), microbatches, pp, pp * per_rank)
    except ConfigError:
        pytest.skip("torchpre does not run this schedule with these microbatches")
    walked = [held_peak(name, pp, microbatches, rank, [1.0] * per_rank) for rank in range(pp)]
    closed = [get_schedule(name).in_flight_microbatches(pp, microbatches, rank, per_rank) for rank in range(pp)]
    assert walked == closed


def test_an_interleaved_last_stage_is_held_for_one_microbatch_at_the_peak():
    """Interleaved 1F1B at pp8 with 16 microbatches (torchtitan's 405B row): the last rank holds 9 chunk-forwards at
    its peak, 8 of its first chunk and 1 of the last stage, whose backward follows its forward at once. With the last
    stage's chunk 10 times the other's (its logits), the peak is 8 + 10, not 9 x 10."""
    assert get_schedule("Interleaved1F1B").in_flight_microbatches(8, 16, 7, 2) == 9
    assert held_peak("Interleaved1F1B", 8, 16, 7, [1.0, 10.0]) == 18
    assert held_peak("Interleaved1F1B", 8, 16, 0, [1.0, 1.0]) == 23  # the first rank holds no last stage
    assert held_peak("1F1B", 8, 16, 7, [10.0]) == 10


def _walk_weighted(actions: list, stage_ids: list[int], weights: list[float]) -> float:
    """The most of `weights` (per local chunk, in `stage_ids` order) held at once over torch's actions of one rank."""
    local = {stage: chunk for chunk, stage in enumerate(stage_ids)}
    held = peak = 0.0
    for action in actions:
        for step in (action.sub_actions or (action,)) if action is not None else ():
            sign = (step.computation_type == torch_schedules.FORWARD) - (step.computation_type in FREES)
            held += sign * weights[local[step.stage_index]]
            peak = max(peak, held)
    return peak


def test_a_chunk_holding_the_embedding_alone_holds_no_block_at_the_peak():
    """Meta's 405B split (parallelism.pipeline_parallel_embedding_layers = output_layers = 1; 126 blocks over pp16 x 8
    one-unit stages) with 32 microbatches per step: the first rank runs 143 chunk-forwards at its peak, 31 of them
    through stage 0, the embedding alone, so it holds 112 block-microbatches, not 143."""
    name, pp, microbatches, per_rank = "Interleaved1F1B", 16, 32, 8
    blocks = [0.0, *[1.0] * 7]  # stage 0 (the embedding), then stages 16, 32, ..., 112 (a block each)
    order = _torch_order(name, pp, microbatches, per_rank)
    stage_ids = get_schedule(name).stage_ids(0, pp, per_rank)
    assert _walk_weighted(order[0], stage_ids, [1.0] * per_rank) == 143
    assert _walk_weighted(order[0], stage_ids, blocks) == held_peak(name, pp, microbatches, 0, blocks) == 112
