"""ZeRO-3 (FSDP2) through train.py gives ZeRO-0's per-step losses on every layout it composes with.

CI runs a covering sample (TP with sequence parallelism, PP with a weight tied across stages, HSDP, experts sharded
over ep and FSDP, FSDP units per sub-layer); the other cases run with `-m zero_matrix`.
"""

import pytest

from tests.launch import DEBUG, train_and_read_metrics

pytestmark = pytest.mark.slow

# fp32 on CPU: ZeRO-3 changes only where the DP sums happen (reduce-scatter per block during backward instead of
# one all-reduce after it) and where AdamW runs (on shards): reduction-order noise. Measured over these 10
# steps: losses equal to the last printed digit (< 1e-6).
LOSS_ATOL = 1e-5
# The norm's squares are summed in fp64 (parallel/grad_clip.py), so sharding changes it no more than the loss.
NORM_RTOL = 1e-5

STEPS = ["--training.steps", "10"]
ACCUMULATE_2 = ["--training.local_batch_size", "2", "--training.global_batch_size", "8"]  # at dp2
ZERO3 = ["--optimizer.zero_stage", "3"]
TP2_SP = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_sequence_parallel"]
SUBLAYER = ["--parallelism.fsdp_wrap", "sublayer"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B"]

# name: (processes, the layout's arguments, ZeRO-3's extra arguments)
CASES = {
    "dp2_tp2_sp": (4, [*ACCUMULATE_2, *TP2_SP], []),
    "dp2_pp2_1f1b_tied": (4, [*ACCUMULATE_2, *PP2, "--model.flavor", "debugmodel_tied"], []),
    # 4 data-parallel ranks: 2 replica groups of 2 shards, against plain dp4.
    "hsdp2x2": (4, ["--training.local_batch_size", "1", "--training.global_batch_size", "8"],
                ["--parallelism.data_parallel_replicate_degree", "2"]),
    "dp2": (2, ACCUMULATE_2, []),
    "dp2_compile_ac": (2, [*ACCUMULATE_2, "--compile.enable", "--activation_checkpoint.mode", "full"], []),
    # Mixture of Experts without expert parallelism: each MoE block, router and experts included, is one FSDP group.
    "moe_dp2": (2, [*ACCUMULATE_2, "--model.name", "moe"], []),
    # dp4 x ep2: the experts are FSDP groups of their own, sharded over the edp_shard = 2 ranks holding them.
    "moe_dp4_ep2": (4, ["--model.name", "moe", "--parallelism.expert_parallel_degree", "2",
                        "--training.local_batch_size", "1", "--training.global_batch_size", "8"], []),
    # parallelism.fsdp_wrap = "sublayer": each block's attention and feed-forward are FSDP groups inside the block's.
    "dp2_sublayer": (2, ACCUMULATE_2, SUBLAYER),
    "dp2_compile_ac_sublayer": (2, [*ACCUMULATE_2, "--compile.enable", "--activation_checkpoint.mode", "full"],
                                SUBLAYER),
    "hsdp2x2_sublayer": (4, ["--training.local_batch_size", "1", "--training.global_batch_size", "8"],
                         ["--parallelism.data_parallel_replicate_degree", "2", *SUBLAYER]),
    "dp2_tp2_sp_sublayer": (4, [*ACCUMULATE_2, *TP2_SP], SUBLAYER),
    "dp2_pp2_1f1b_sublayer": (4, [*ACCUMULATE_2, *PP2], SUBLAYER),
    "moe_dp4_ep2_sublayer": (4, ["--model.name", "moe", "--parallelism.expert_parallel_degree", "2",
                                 "--training.local_batch_size", "1", "--training.global_batch_size", "8"], SUBLAYER),
}
CI_SAMPLE = ("dp2_tp2_sp", "dp2_pp2_1f1b_tied", "hsdp2x2", "moe_dp4_ep2", "dp2_sublayer", "moe_dp4_ep2_sublayer")


@pytest.fixture(autouse=True)
def _cpu_only(monkeypatch):
    """FSDP follows the device it sees; with gloo a visible GPU crashes it (pytorch/pytorch#132471)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


CASE_PARAMS = [
    pytest.param(name, id=name, marks=() if name in CI_SAMPLE else (pytest.mark.zero_matrix,)) for name in CASES
]


@pytest.mark.parametrize("name", CASE_PARAMS)
def test_zero3_gives_zero0_losses(name, tmp_path):
    nproc, layout, extra = CASES[name]
    args = [*DEBUG, *STEPS, *layout]
    reference = train_and_read_metrics(args, nproc, tmp_path / "zero0")
    records = train_and_read_metrics([*args, *ZERO3, *extra], nproc, tmp_path / "zero3")
    assert [r["step"] for r in records] == list(range(1, 11))
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in reference], abs=LOSS_ATOL)
    assert [r["grad_norm"] for r in records] == pytest.approx([r["grad_norm"] for r in reference], rel=NORM_RTOL)
    # It trained, so the runs are not two copies of the initial weights (the MoE debug model's loss falls least:
    # 8.030 -> 8.022 over these 10 steps).
    assert records[-1]["loss"] < records[0]["loss"] - 0.005
