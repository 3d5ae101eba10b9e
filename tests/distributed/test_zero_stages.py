"""ZeRO stages 1 and 2 train like stage 0 in every layout: per-step losses and grad norms of train.py over 10 steps
with gradient accumulation (2 microbatches per DP rank, so stage 1 reduces during the last one's backward and
stage 2 reduce-scatters both), at dp2, dp2 x tp2 (sequence parallel), dp2 x pp2 (1F1B) and for the MoE model
with its experts over ep2 (dp2: experts not DP-sharded; dp4: edp 2).

CI runs a covering sample (every stage and every layout at least once); `-m zero_matrix` runs every pair.
"""

import pytest

from tests.launch import DEBUG as DEBUG_MODEL
from tests.launch import train_and_read_metrics

pytestmark = pytest.mark.slow

# fp32 on CPU: the stages differ only in where sums happen (reduce-scatter vs all-reduce, per microbatch or
# once, TP and tied sums on shards) and where AdamW runs (a shard per rank): reduction-order noise, ~1e-7 per
# operation; the bound.
LOSS_ATOL = 1e-5
# The norm's squares are summed in fp64 (parallel/grad_clip.py), so sharding changes it no more than the loss.
GRAD_NORM_RTOL = 1e-5

# global batch 8 = dp 2 x local 2 x accumulation 2
COMMON = [*DEBUG_MODEL, "--training.steps", "10", "--training.global_batch_size", "8"]
TP2_SP = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_sequence_parallel"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B"]
MOE = ["--model.name", "moe", "--model.flavor", "debugmodel", "--parallelism.expert_parallel_degree", "2"]

LAYOUTS = {
    "dp2": (2, ["--training.local_batch_size", "2"]),
    "dp2xtp2": (4, ["--training.local_batch_size", "2", *TP2_SP]),
    "dp2xpp2": (4, ["--training.local_batch_size", "2", *PP2]),
    "moe-ep2xdp2": (2, ["--training.local_batch_size", "2", *MOE]),
    "moe-ep2xdp4": (4, ["--training.local_batch_size", "1", *MOE]),
}
STAGES = {
    "zero1": ["--optimizer.zero_stage", "1"],
    "zero2": ["--optimizer.zero_stage", "2"],
    "zero2-local": ["--optimizer.zero_stage", "2", "--optimizer.zero2_accumulate_locally"],
}
# Every stage and every dense layout at least once (stage 1 at dp2 x pp2 is also in test_zero.py), and the MoE
# layout whose experts are DP-sharded too (edp 2). CI: about 2 minutes; every pair: 4 minutes.
SAMPLE = {("dp2", "zero1"), ("dp2", "zero2"), ("dp2", "zero2-local"), ("dp2xtp2", "zero2"), ("dp2xpp2", "zero2"),
          ("moe-ep2xdp4", "zero2")}
CASES = [
    pytest.param(layout, stage, id=f"{layout}-{stage}",
                 marks=() if (layout, stage) in SAMPLE else pytest.mark.zero_matrix)
    for layout in LAYOUTS
    for stage in STAGES
]


@pytest.fixture(scope="module")
def stage0(tmp_path_factory):
    """The ZeRO-0 run of each layout, run once per module when a case first asks for it."""
    runs: dict[str, list[dict]] = {}

    def records(layout: str) -> list[dict]:
        if layout not in runs:
            nproc, args = LAYOUTS[layout]
            runs[layout] = train_and_read_metrics([*COMMON, *args], nproc, tmp_path_factory.mktemp(f"{layout}-zero0"))
        return runs[layout]

    return records


@pytest.mark.parametrize("layout, stage", CASES)
def test_zero_stages_give_the_same_losses(layout, stage, stage0, tmp_path):
    nproc, args = LAYOUTS[layout]
    records = train_and_read_metrics([*COMMON, *args, *STAGES[stage]], nproc, tmp_path)
    reference = stage0(layout)
    assert [r["step"] for r in records] == [r["step"] for r in reference] == list(range(1, 11))
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in reference], abs=LOSS_ATOL)
    assert [r["grad_norm"] for r in records] == pytest.approx([r["grad_norm"] for r in reference], rel=GRAD_NORM_RTOL)
    # it trained, so the runs are not equal by staying at the initial weights (measured over the 10 steps: dense
    # 8.12 -> 8.07, MoE 8.030 -> 8.022)
    assert reference[-1]["loss"] < reference[0]["loss"] - 0.005
