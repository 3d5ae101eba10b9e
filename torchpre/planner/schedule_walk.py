"""The activations a pipeline rank holds at its peak, walked over torch's own action order.

A schedule's row (`torchpre.step_rules.schedules`) gives the most stage-chunk forwards a rank holds at once, which is
the rank's peak when its chunks save the same bytes. They do not when one of them is the last stage: its chunk
also keeps the output layer's logits and the loss, and on a multi-stage schedule the backward of the last stage
follows its forward at once (the loss is right there), so the rank's peak holds many microbatches of its other
chunks and one of the last. Counting every chunk at the largest one's size put torchtitan's interleaved 405B row
14% over what it reserved, and Megatron's 530B and 1T runs over the card.

`held_peak` adds a chunk's bytes at each of its forwards and frees them at its full backward (B) or input
backward (I: the weight backward W keeps only the matmul inputs, counted in the transient), in the order torch's
schedule classes build (`pipeline_order`, from stand-in stages as `tests/unit/test_schedule_theory.py` builds
them), and takes the largest total. A single-stage schedule holds one chunk, so its peak is the table's count.
"""

import functools
from collections.abc import Sequence
from types import SimpleNamespace

import torch
from torch.distributed.pipelining import schedules as torch_schedules

from torchpre.step_rules.schedules import get_schedule

_FREES = (torch_schedules.FULL_BACKWARD, torch_schedules.BACKWARD_INPUT)


def held_peak(name: str, pp: int, microbatches: int, rank: int, chunk_bytes: Sequence[float]) -> float:
    """The most bytes pipeline rank `rank` holds at once, its stage chunk i (in `stage_ids` order) holding
    `chunk_bytes[i]` per microbatch from its forward to its backward."""
    row = get_schedule(name)
    per_rank = len(chunk_bytes)
    if not row.multi_stage:
        return row.in_flight_microbatches(pp, microbatches, rank, per_rank) * chunk_bytes[0]
    held = peak = 0.0
    for chunk, sign in _rank_actions(row.name, pp, microbatches, per_rank)[rank]:
        held += sign * chunk_bytes[chunk]
        peak = max(peak, held)
    return peak


@functools.cache
def _rank_actions(name: str, pp: int, microbatches: int, per_rank: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """For each rank, its (local chunk, +1 for a forward / -1 for a backward that frees) in torch's order."""
    row = get_schedule(name)
    num_stages = pp * per_rank
    stages = [
        SimpleNamespace(num_stages=num_stages, group_size=pp, group_rank=0, stage_index=index, is_first=index == 0,
                        is_last=index == num_stages - 1, submod=torch.nn.Module())
        for index in row.stage_ids(0, pp, per_rank)
    ]  # fmt: skip
    schedule = _compute_only(row.torch_class)(stages, microbatches, loss_fn=lambda output, target: output)
    ranks = []
    for rank in range(pp):
        local = {stage: chunk for chunk, stage in enumerate(row.stage_ids(rank, pp, per_rank))}
        steps = []
        for action in schedule.pipeline_order[rank]:
            for step in (action.sub_actions or (action,)) if action is not None else ():
                if step.computation_type == torch_schedules.FORWARD:
                    steps.append((local[step.stage_index], 1))
                elif step.computation_type in _FREES:
                    steps.append((local[step.stage_index], -1))
        ranks.append(tuple(steps))
    return tuple(ranks)


@functools.cache
def _compute_only(torch_class: str) -> type:
    """torch's schedule class without the send/receive and unshard/reshard actions it adds to the compute order
    (`_prepare_schedule_with_comms`, quadratic in the actions: 9 s at pp16 x 1,024 microbatches): the walk reads
    `pipeline_order`, the compute actions alone."""

    def compute_actions_only(self, *args, **kwargs) -> None:
        pass

    return type(f"{torch_class}ComputeOnly", (getattr(torch_schedules, torch_class),),
                {"_prepare_schedule_with_comms": compute_actions_only})
