"""A search's layouts predicted by forked worker processes, one per core.

Measuring pieces is what a search spends its time on, one process at a time; the pieces of layouts with different
tensor-parallel degrees never coincide (every key holds tp), so the layouts are dealt out by tp, each worker
measures and predicts its share, and sends back the predictions' numbers and the pieces it measured, which the
next phase (the cp layouts, whose state reuses the pieces without cp) and the caller's caches keep. Forked, so a
worker starts with everything measured before it and runs the same code as one process: the predictions are the
same numbers (`tests/unit/test_plan.py`).
"""

import multiprocessing
from collections.abc import Callable
from typing import Any

from torchpre.planner import stage_costs
from torchpre.planner.cost_cache import Measured
from torchpre.planner.hardware import Hardware
from torchpre.planner.layout_space import CheckedLayout
from torchpre.planner.predict import Prediction, predict

_TASK: dict[str, Any] = {}  # what the workers fork with: the layouts, the hardware, the shared counters
_CACHES = (stage_costs._CACHE, stage_costs._STEP_CACHE, stage_costs._STATE_BUILDS)


def deal_by_tp(checked: list[CheckedLayout], workers: int) -> list[list[int]]:
    """Indices of `checked` in at most `workers` shares, whole tp groups each, the largest group first to the
    share with the fewest layouts."""
    groups: dict[int, list[int]] = {}
    for index, layout in enumerate(checked):
        groups.setdefault(layout.layout.tp, []).append(index)
    shares: list[list[int]] = [[] for _ in range(min(workers, len(groups)))]
    for group in sorted(groups.values(), key=len, reverse=True):
        min(shares, key=len).extend(group)
    return shares


def predict_in_workers(
    checked: list[CheckedLayout], hardware: Hardware, gpus: int, flops: int, measured: Measured, workers: int,
    report: Callable[[int, int], None],
) -> list[Prediction]:  # fmt: skip
    """`predict` of every layout, in `workers` forked processes; `report(done, pieces)` while they run. The pieces
    they measured join `measured` and `torchpre.planner.stage_costs`' caches. The caller must not have run autograd
    (torch's engine threads do not survive a fork): `python -m torchpre.plan` never does before it searches."""
    shares = deal_by_tp(checked, workers)
    context = multiprocessing.get_context("fork")
    done, found = context.Array("i", len(shares)), context.Array("i", len(shares))
    _TASK.update(checked=checked, hardware=hardware, gpus=gpus, flops=flops, measured=measured, done=done,
                 found=found)  # fmt: skip
    try:
        with context.Pool(len(shares)) as pool:
            running = pool.map_async(_predict_share, list(enumerate(shares)))
            while not running.ready():
                running.wait(0.5)
                report(sum(done), len(measured) + sum(found))
            results = running.get()
    finally:
        _TASK.clear()
    predictions: list[Prediction | None] = [None] * len(checked)
    for numbers, new_pieces, new_caches in results:
        for index, ranks, step, tokens in numbers:
            predictions[index] = Prediction(checked[index], ranks, step, tokens, flops, gpus, hardware)
        measured.update(new_pieces)
        for cache, new in zip(_CACHES, new_caches):
            cache.update(new)
    report(len(checked), len(measured))
    return predictions


def _predict_share(task: tuple[int, list[int]]) -> tuple[list[tuple], dict, list[dict]]:
    """In a worker: its share's predictions as numbers, and the pieces and cache entries it added."""
    worker, indices = task
    checked, measured = _TASK["checked"], _TASK["measured"]
    before = len(measured), [set(cache) for cache in _CACHES]
    known = set(measured.found())
    numbers = []
    for index in indices:
        prediction = predict(checked[index], _TASK["hardware"], _TASK["gpus"], _TASK["flops"], measured)
        numbers.append((index, prediction.ranks, prediction.step, prediction.tokens_per_step))
        _TASK["done"][worker] += 1
        _TASK["found"][worker] = len(measured) - before[0]
    new_pieces = {key: value for key, value in measured.found().items() if key not in known}
    new_caches = [{key: value for key, value in cache.items() if key not in old} for cache, old in
                  zip(_CACHES, before[1])]  # fmt: skip
    return numbers, new_pieces, new_caches
