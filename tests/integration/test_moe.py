"""The Mixture-of-Experts family under expert parallelism (composed with DP, ZeRO-1, PP and TP) and under
expert tensor parallelism against one process, its router statistics, and a checkpoint resharded from
experts split by expert to experts split by hidden unit; DeepSeek-V3's routing with bias balancing likewise,
its routing biases bitwise equal to one process's on every rank, across a resharded resume too."""

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.launch import MOE_TINY, assert_trained, run_train, train_and_read_metrics
from torchpre.errors import ConfigError
from torchpre.models.moe.args import MOE_FLAVORS
from torchpre.models.moe.spec import SPEC

pytestmark = pytest.mark.slow

MOE = [
    *MOE_TINY,
    "--training.steps", "8",
    "--lr_scheduler.warmup_steps", "2",
    "--optimizer.lr", "3e-3",
    "--metrics.log_freq", "1",
]
# fp32 on CPU: layouts differ in reduction order only (the all-to-all moves rows, it adds nothing), and the
# routing decisions agree (a flipped top-k choice would move the loss by far more than this).
LOSS_TOLERANCE = 1e-4
ROUTER_KEYS = ("moe/load_imbalance", "moe/min_load", "moe/aux_loss")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    return train_and_read_metrics(MOE, 1, tmp_path_factory.mktemp("moe-reference"))


def test_router_statistics_are_logged_and_training_balances_the_load(reference):
    for record in reference:
        assert 1 <= record["moe/load_imbalance"] < 4
        assert 0 <= record["moe/min_load"] <= 1
        assert record["moe/aux_loss"] >= 1 - 1e-6  # num_experts x sum f P is at least 1, equal when even
    assert_trained(reference)


@pytest.mark.parametrize(
    "layout, nproc",
    [
        (["--parallelism.expert_parallel_degree", "2"], 2),
        (["--parallelism.expert_parallel_degree", "2", "--optimizer.zero_stage", "1"], 4),
        (["--parallelism.expert_parallel_degree", "2", "--parallelism.pipeline_parallel_degree", "2"], 4),
        (
            ["--parallelism.expert_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2",
             "--parallelism.enable_sequence_parallel"],
            4,
        ),
        # No ep: the experts are sharded over tp by their hidden dimension instead.
        (["--parallelism.tensor_parallel_degree", "2", "--optimizer.zero_stage", "1"], 4),
        # ep carved from the cp ranks: each holds half of every sequence, and the load-balancing loss sums its
        # statistics over them (measured: losses within 9.6e-7 of one process).
        (["--parallelism.context_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2"], 2),
    ],
    ids=["ep2", "ep2xdp2-zero1", "ep2xpp2", "ep2xtp2-sp", "dp2xtp2-zero1", "cp2xep2"],
)
def test_layout_matches_one_process(reference, layout, nproc, tmp_path):
    records = train_and_read_metrics([*MOE, *layout], nproc, tmp_path)
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in reference], abs=LOSS_TOLERANCE)
    assert [r["grad_norm"] for r in records] == pytest.approx([r["grad_norm"] for r in reference], rel=1e-4)
    for key in ROUTER_KEYS:  # the same tokens go to the same experts, whichever rank holds them
        assert [r[key] for r in records] == pytest.approx([r[key] for r in reference], rel=1e-6)


def test_checkpoint_saved_at_ep2_resumes_at_ep1_tp2(reference, tmp_path):
    """Experts saved sharded by expert (ep2) load at ep1, sharded by hidden unit over tp2 instead."""
    checkpoint = ["--checkpoint.enable", "--checkpoint.interval", "4"]
    result = run_train([*MOE, *checkpoint, "--parallelism.expert_parallel_degree", "2"], 2, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    (tmp_path / "checkpoint" / "step-8").rename(tmp_path / "step-8-done")  # resume from step 4
    (tmp_path / "metrics.jsonl").unlink()
    records = train_and_read_metrics([*MOE, *checkpoint, "--parallelism.tensor_parallel_degree", "2"], 2, tmp_path)
    assert [r["step"] for r in records] == [5, 6, 7, 8]
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in reference[4:]], abs=LOSS_TOLERANCE)


def test_moe_under_context_parallel_prints_no_warning(tmp_path):
    """The load-balancing loss's sum over the cp ranks used a differentiable all-reduce that torch 2.14 warns about,
    on every rank, at every step."""
    result = run_train([*MOE_TINY, "--training.steps", "2", "--parallelism.context_parallel_degree", "2"], 2, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Warning" not in result.stdout + result.stderr, (result.stdout + result.stderr)[-3000:]


def test_expert_degree_must_divide_the_experts():
    with pytest.raises(ConfigError, match="num_experts = 4 is not divisible by parallelism.expert_parallel_degree = 3"):
        SPEC.parallel.validate_expert_parallel(MOE_FLAVORS["tiny"], 3)


def test_tensor_degree_must_divide_the_expert_width():
    args = dataclasses.replace(MOE_FLAVORS["tiny"], moe_hidden_dim=31)
    with pytest.raises(ConfigError, match="moe_hidden_dim = 31 is not divisible by parallelism.tensor_parallel_degree"):
        SPEC.parallel.validate_tensor_parallel(args, 2)


# DeepSeek-V3's routing (tiny_dsv3: sigmoid, groups, scaling, z-loss, a dense first block) with the balancing bias on.
DSV3 = [*MOE, "--model.flavor", "tiny_dsv3"]
# fp32 on CPU, reduction order only (measured: dp2 ZeRO-1 and ep2 within 9.6e-7 of one process). The biases are
# compared bitwise: they move by +-rate from exact integer counts, so one flipped choice in the job would show.
DSV3_LOSS_TOLERANCE = 1e-5
EP2 = ["--parallelism.expert_parallel_degree", "2"]
DP2_ZERO1 = ["--parallelism.data_parallel_degree", "2", "--optimizer.zero_stage", "1"]
SAVE_AT_4 = ["--checkpoint.enable", "--checkpoint.interval", "4"]


def train_and_dump(args: list[str], nproc: int, folder: Path) -> tuple[list[dict], list[dict[str, torch.Tensor]]]:
    """The metrics records and each rank's persistent buffers (the routing biases) after training."""
    records = train_and_read_metrics(args, nproc, folder, script="tests/train_and_dump.py")
    return records, [torch.load(folder / f"buffers_rank{rank}.pt") for rank in range(nproc)]


@pytest.fixture(scope="module")
def dsv3_reference(tmp_path_factory) -> tuple[list[dict], dict[str, torch.Tensor]]:
    records, (biases,) = train_and_dump(DSV3, 1, tmp_path_factory.mktemp("dsv3-reference"))
    return records, biases


def assert_dsv3_matches(
    records: list[dict],
    biases: list[dict],
    reference: tuple[list[dict], dict],
    stages: bool = False,
    extra_keys: tuple[str, ...] = (),
    extra_biases: tuple[str, ...] = (),
    layers: int = 3,
) -> None:
    """Losses, router statistics and `extra_keys` as one process's, and each rank's routing biases bitwise equal to
    its: every rank holds every layer's (the `layers` - 1 after the dense first, and `extra_biases`), or with
    `stages` (a pipeline split) its stage's, the stages together holding all."""
    ref_records, ref_biases = reference
    ref_records = ref_records[-len(records):]
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in ref_records], abs=DSV3_LOSS_TOLERANCE)
    for key in (*ROUTER_KEYS, "moe/bias_min", "moe/bias_max"):
        assert [r[key] for r in records] == pytest.approx([r[key] for r in ref_records], rel=1e-6), key
    for key in extra_keys:
        assert [r[key] for r in records] == pytest.approx([r[key] for r in ref_records], abs=DSV3_LOSS_TOLERANCE), key
    assert sorted(ref_biases) == [*(f"layers.{i}.moe.expert_bias" for i in range(1, layers)), *extra_biases]
    assert any(bias.abs().sum() > 0 for bias in ref_biases.values())
    assert set().union(*biases) == ref_biases.keys()
    for rank_biases in biases:
        assert stages or rank_biases.keys() == ref_biases.keys()
        for name, bias in rank_biases.items():
            assert torch.equal(bias, ref_biases[name]), (name, bias, ref_biases[name])


def test_dsv3_routing_balances_the_load(dsv3_reference):
    records, biases = dsv3_reference
    assert all(r["moe/bias_min"] <= 0 <= r["moe/bias_max"] for r in records)
    assert records[-1]["moe/bias_max"] - records[-1]["moe/bias_min"] > 0
    assert_trained(records)


@pytest.mark.parametrize(
    "layout, nproc",
    [
        (DP2_ZERO1, 2),
        # The dense first block under the dense feed-forward's plan, the MoE blocks under theirs.
        (["--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_sequence_parallel"], 2),
        pytest.param([*EP2, "--optimizer.zero_stage", "1"], 4, marks=pytest.mark.parity_matrix),
    ],
    ids=["dp2-zero1", "tp2-sp", "ep2xdp2-zero1"],
)
def test_dsv3_layout_matches_one_process_biases_included(dsv3_reference, layout, nproc, tmp_path):
    assert_dsv3_matches(*train_and_dump([*DSV3, *layout], nproc, tmp_path), dsv3_reference)


def test_dsv3_at_ep2_matches_one_process_and_its_biases_resume_bitwise_at_dp2_zero1(dsv3_reference, tmp_path):
    """ep2 for 8 steps against one process, then a resume of its step-4 checkpoint under dp2 ZeRO-1: the loaded
    biases keep moving as one process's do, to the bit."""
    assert_dsv3_matches(*train_and_dump([*DSV3, *SAVE_AT_4, *EP2], 2, tmp_path), dsv3_reference)
    (tmp_path / "checkpoint" / "step-8").rename(tmp_path / "step-8-done")  # resume from step 4
    (tmp_path / "metrics.jsonl").unlink()
    records, biases = train_and_dump([*DSV3, *SAVE_AT_4, *DP2_ZERO1], 2, tmp_path)
    assert [r["step"] for r in records] == [5, 6, 7, 8]
    assert_dsv3_matches(records, biases, dsv3_reference)


# The deepseek_v3 family (multi-head latent attention on the same routing, balancing on): its tensor-parallel plan
# (heads sharded, the latents' down-projections replicated) and its pipeline split in CI, the rest opt-in. Held to
# DSV3_LOSS_TOLERANCE (measured over 8 steps: every row within 9.6e-7 of one process), the biases bitwise equal, and
# where every rank holds the whole model, its (gathered) parameters bitwise equal on every rank: a replicated weight
# whose gradient misses a rank's share diverges there long before the loss shows it (the RoPE key's gradient left
# unsummed over tp moved the loss by 1.9e-6 only).
#
# With two multi-token prediction depths (MoE blocks after the main ones, on the last stage with their copy of the
# embedding): their losses (`loss/mtp_k`) match too, and they move the parameters (the loss and every gradient
# include them).
DEEPSEEK_V3 = [*MOE, "--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--model.mtp_depth", "2"]
MTP_KEYS = ("loss/mtp_1", "loss/mtp_2")
MTP_BIASES = ("mtp.depths.1.block.moe.expert_bias", "mtp.depths.2.block.moe.expert_bias")
TP2_SP_LP = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_sequence_parallel",
             "--parallelism.enable_loss_parallel"]  # fmt: skip
PP2_1F1B = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B"]


@pytest.fixture(scope="module")
def deepseek_v3_reference(tmp_path_factory) -> tuple[list[dict], dict[str, torch.Tensor]]:
    records, (biases,) = train_and_dump(DEEPSEEK_V3, 1, tmp_path_factory.mktemp("deepseek-v3-reference"))
    return records, biases


@pytest.mark.parametrize(
    "layout, nproc",
    [
        (TP2_SP_LP, 2),
        (PP2_1F1B, 2),
        pytest.param(DP2_ZERO1, 2, marks=pytest.mark.parity_matrix),
        pytest.param(EP2, 2, marks=pytest.mark.parity_matrix),
        pytest.param(["--parallelism.context_parallel_degree", "2"], 2, marks=pytest.mark.parity_matrix),
        pytest.param(["--parallelism.data_parallel_degree", "2", "--optimizer.zero_stage", "3"], 2,
                     marks=pytest.mark.parity_matrix),
        # dp2 x ep2 x tp2: the experts split over ep2 carved from the dp ranks, tp2 + SP + LP over the rest.
        pytest.param([*EP2, "--parallelism.data_parallel_degree", "2", *TP2_SP_LP], 4,
                     marks=pytest.mark.parity_matrix),
        pytest.param(["--parallelism.data_parallel_degree", "2", "--optimizer.zero_stage", "2"], 2,
                     marks=pytest.mark.parity_matrix),
        pytest.param(["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree",
                      "2", "--optimizer.zero_stage", "3"], 4, marks=pytest.mark.parity_matrix),
        pytest.param([*DP2_ZERO1, "--activation_checkpoint.mode", "full"], 2, marks=pytest.mark.parity_matrix),
        pytest.param([*DP2_ZERO1, "--activation_checkpoint.mode", "selective", "--compile.enable"], 2,
                     marks=pytest.mark.parity_matrix),
    ],
    ids=["tp2-sp-lp", "pp2-1f1b", "dp2-zero1", "ep2", "cp2", "dp2-zero3", "dp2-ep2-tp2-sp-lp", "dp2-zero2",
         "hsdp2x2", "dp2-zero1-full-ac", "dp2-zero1-selective-ac-compile"],
)
def test_deepseek_v3_layout_matches_one_process_biases_included(deepseek_v3_reference, layout, nproc, tmp_path):
    records, biases = train_and_dump([*DEEPSEEK_V3, *layout], nproc, tmp_path)
    assert_dsv3_matches(
        records, biases, deepseek_v3_reference, stages=layout is PP2_1F1B, extra_keys=MTP_KEYS, extra_biases=MTP_BIASES
    )
    if layout is not PP2_1F1B:
        first, *others = (torch.load(tmp_path / f"params_rank{rank}.pt") for rank in range(nproc))
        for params in others:
            assert params.keys() == first.keys()
            assert [name for name, value in params.items() if not torch.equal(value, first[name])] == []


# Every other pipeline schedule with the two multi-token prediction depths, on `debugmodel_pp` (4 blocks, so the
# interleaved and V schedules hold two stages per rank). The MTP modules and the embedding's copy land with the last
# stage: on rank 1, or under the V schedules (ZBVZeroBubble, DualPipeV) on rank 0 beside the first stage, the two copies
# then in two stages of one rank, their gradients summed there. The zero-bubble schedules split each backward into an
# input and a weight step, and the MoE layers' balancing loss (`AddAuxLoss`) and MTP's loss enter the gradient inside
# the stages: torchtitan's aux loss was wrong under exactly these (PR #2061), and torch's weight step failed on the
# copy, which every depth reads (`torchpre.parallel.pipeline.disjoint_param_groups`). Losses, MTP losses and router
# statistics within DSV3_LOSS_TOLERANCE of one process (measured over 8 steps: 9.5e-7 for every schedule), routing
# biases bitwise equal, the two embedding copies bitwise equal wherever they are. ZBVZeroBubble in CI (the last stage on
# rank 0, zero bubble), the rest opt-in.
DEEPSEEK_V3_PP = [*MOE, "--model.name", "deepseek_v3", "--model.flavor", "debugmodel_pp", "--model.mtp_depth", "2"]
MTP_STAGE_RANK = {"GPipe": 1, "Interleaved1F1B": 1, "LoopedBFS": 1, "InterleavedZeroBubble": 1, "ZBVZeroBubble": 0,
                  "DualPipeV": 0}  # fmt: skip
TWO_STAGES_PER_RANK = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")


@pytest.fixture(scope="module")
def deepseek_v3_pp_reference(tmp_path_factory) -> tuple[list[dict], dict[str, torch.Tensor]]:
    records, (biases,) = train_and_dump(DEEPSEEK_V3_PP, 1, tmp_path_factory.mktemp("deepseek-v3-pp-reference"))
    return records, biases


@pytest.mark.parametrize(
    "schedule",
    [name if name == "ZBVZeroBubble" else pytest.param(name, marks=pytest.mark.parity_matrix)
     for name in MTP_STAGE_RANK],
)
def test_deepseek_v3_with_mtp_under_every_pipeline_schedule_matches_one_process(
    deepseek_v3_pp_reference, schedule, tmp_path
):
    virtual = ["--parallelism.pipeline_parallel_virtual_stages", "2"] if schedule in TWO_STAGES_PER_RANK else []
    layout = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", schedule]
    records, biases = train_and_dump([*DEEPSEEK_V3_PP, *layout, *virtual], 2, tmp_path)
    assert_dsv3_matches(
        records, biases, deepseek_v3_pp_reference, stages=True, extra_keys=MTP_KEYS, extra_biases=MTP_BIASES,
        layers=4,
    )
    params = [torch.load(tmp_path / f"params_rank{rank}.pt") for rank in range(2)]
    for prefix in ("mtp.", "mtp_embeddings.", "output."):  # with the last stage, on one rank
        assert [rank for rank in range(2) if any(name.startswith(prefix) for name in params[rank])] == [
            MTP_STAGE_RANK[schedule]
        ], prefix
    embedding = next(p["tok_embeddings.weight"] for p in params if "tok_embeddings.weight" in p)
    assert torch.equal(params[MTP_STAGE_RANK[schedule]]["mtp_embeddings.weight"], embedding)


@pytest.fixture(scope="module")
def deepseek_v3_docmask_reference(tmp_path_factory) -> tuple[list[dict], dict[str, torch.Tensor]]:
    records, (biases,) = train_and_dump([*DEEPSEEK_V3, *DOCUMENT_MASK], 1, tmp_path_factory.mktemp("dsv3-docmask"))
    return records, biases


DOCUMENT_MASK = ["--training.document_mask"]


@pytest.mark.parity_matrix
@pytest.mark.parametrize(
    "layout", [["--parallelism.context_parallel_degree", "2"], PP2_1F1B], ids=["cp2-docmask", "pp2-1f1b-docmask"]
)
def test_deepseek_v3_with_the_document_mask_matches_one_process(deepseek_v3_docmask_reference, layout, tmp_path):
    """Multi-token prediction's blocks attend within documents as the main ones, under cp the tokens ahead read
    from the whole rows (a rank's last positions' tokens ahead are another rank's)."""
    records, biases = train_and_dump([*DEEPSEEK_V3, *DOCUMENT_MASK, *layout], 2, tmp_path)
    assert_dsv3_matches(
        records, biases, deepseek_v3_docmask_reference, stages=layout is PP2_1F1B, extra_keys=MTP_KEYS,
        extra_biases=MTP_BIASES,
    )
