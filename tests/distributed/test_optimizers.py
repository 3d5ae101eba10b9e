"""Optimizers other than AdamW under ZeRO: their state sharded over DP (and cut within TP shards) trains like the
replicated state and like one process; Muon, whose update needs whole matrices, under every way a matrix is sharded
(ZeRO 1-3, HSDP, TP, TP within ZeRO, pipeline stages with tied embeddings, experts over ep and edp).
Their checkpoints' round trip under resharding is in the reshard matrix
(tests/reshard_matrix.py, axis `optimizer`)."""

from collections.abc import Callable

import pytest

from tests.launch import MOE_TINY, TINY, train_and_read_params
from torchpre.optim.muon import hidden_matrices

pytestmark = pytest.mark.slow

# fp32 on CPU: ZeRO-1 changes only where each update is computed (a shard per rank) and how gradients are summed
# (reduce-scatter instead of all-reduce), TP the order of the sharded matmuls' sums: reduction-order noise,
# ~1e-7 per operation. A lost momentum buffer, a shard stepped twice or a wrong chunk moves losses and
# parameters by far more than 1e-5 within a step or two at these learning rates.
LOSS_ATOL = 1e-5
# RMSprop divides by the root of its squared-gradient average, which is tiny where an element's gradients are,
# so that reduction noise reaches the parameters larger: measured 2.5e-6 on an idle machine, 1.2e-5 once in CI.
# Muon (fp32 iteration, lr 3e-3), measured over its 9 layouts: Muon's matrices within 8e-8, AdamW's embeddings within
# 4.1e-6 (Adam's normalised step magnifies the noise of rarely seen rows), losses within 9.5e-7.
PARAM_ATOL = {"SGD": 1e-5, "RMSprop": 3e-5, "Muon": 1e-5}

STEPS = ["--training.steps", "5"]
OPTIMIZERS = {
    "SGD": ["--optimizer.name", "SGD", "--optimizer.momentum", "0.9", "--optimizer.lr", "0.05"],
    "RMSprop": ["--optimizer.name", "RMSprop", "--optimizer.momentum", "0.5", "--optimizer.lr", "0.002"],
    # fp32 Newton-Schulz: in bf16 the rounding of two layouts' slightly different gradients differs by ~1e-2.
    "Muon": ["--optimizer.name", "Muon", "--optimizer.muon_ns_dtype", "float32", "--optimizer.lr", "0.003"],
}
# The model each layout trains, with the one-process batch of 8 sequences (MoE: 4 microbatches of 2).
MODELS = {
    "tiny": [*TINY, "--training.local_batch_size", "8"],
    "tied": [*TINY, "--model.flavor", "debugmodel_tied", "--training.local_batch_size", "8"],
    "moe": [*MOE_TINY, "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1"],
}
DP2 = ["--training.local_batch_size", "4"]  # the one-process run's 8 sequences a step, over 2 ranks
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
TIED_COPIES = {"output.weight": "tok_embeddings.weight"}  # the tied model's second name: its first's value
# name: (model, processes, arguments)
LAYOUTS = {
    "dp2_zero0": ("tiny", 2, [*DP2, "--optimizer.zero_stage", "0"]),
    "dp2_zero1": ("tiny", 2, [*DP2, "--optimizer.zero_stage", "1"]),
    "dp2_zero2": ("tiny", 2, [*DP2, "--optimizer.zero_stage", "2"]),
    "dp2_zero3": ("tiny", 2, [*DP2, "--optimizer.zero_stage", "3"]),
    "hsdp_2x2": ("tiny", 4, ["--training.local_batch_size", "2", "--optimizer.zero_stage", "3",
                             "--parallelism.data_parallel_replicate_degree", "2"]),
    "tp2_sp": ("tiny", 2, [*TP2, "--parallelism.enable_sequence_parallel"]),
    "dp2_tp2_zero1": ("tiny", 4, [*DP2, "--optimizer.zero_stage", "1", *TP2]),
    "pp2_1f1b_tied": ("tied", 2, ["--parallelism.pipeline_parallel_degree", "2",
                                  "--parallelism.pipeline_parallel_schedule", "1F1B"]),
    "moe_ep2": ("moe", 2, ["--parallelism.expert_parallel_degree", "2"]),
    "moe_dp4_ep2_zero1": ("moe", 4, ["--parallelism.expert_parallel_degree", "2", "--optimizer.zero_stage", "1"]),
}  # fmt: skip
# The generated matrix: the elementwise optimizers under the layouts that shard their state differently; Muon, whose
# update needs whole matrices, under every kind of sharding of a matrix.
CASES = [
    *[(name, layout) for name in ("SGD", "RMSprop") for layout in ("dp2_zero0", "dp2_zero1", "dp2_tp2_zero1")],
    *[("Muon", layout) for layout in LAYOUTS if layout != "dp2_zero0"],
]


# Muon's bytes each rank sends per step, a fraction of its hidden matrices' fp32 bytes (optim/whole_matrices.py):
# split over 2 ranks, each sends half of every matrix (its shard to the owner, or the other's result back); whole on
# every rank (pipeline stages, experts over ep of these models), nothing.
MUON_SENT_FRACTION = {"dp2_zero1": 0.5, "dp2_zero2": 0.5, "dp2_zero3": 0.5, "tp2_sp": 0.5, "pp2_1f1b_tied": 0.0,
                      "moe_ep2": 0.0}  # fmt: skip


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Callable[[str, str], tuple[list[dict], dict]]:
    """Per optimizer and model, the one-process run's records and final parameters, trained on first use."""
    runs: dict[tuple[str, str], tuple[list[dict], dict]] = {}

    def run(optimizer: str, model: str) -> tuple[list[dict], dict]:
        if (optimizer, model) not in runs:
            folder = tmp_path_factory.mktemp(f"{optimizer}_{model}")
            one = [*MODELS[model], *STEPS, *OPTIMIZERS[optimizer]]
            records, params = train_and_read_params(one, 1, folder / "trained")
            # Over 5 steps the loss moves less than from one batch to the next; that the optimizer moved the
            # parameters (so that comparing them means something) shows against the same run at a learning rate
            # of ~0.
            _, frozen = train_and_read_params([*one, "--optimizer.lr", "1e-12"], 1, folder / "frozen")
            moved = max((params[name] - value).abs().max().item() for name, value in frozen.items())
            assert moved > 100 * PARAM_ATOL[optimizer], f"{optimizer} moved the parameters by {moved} only"
            runs[(optimizer, model)] = records, params
        return runs[(optimizer, model)]

    return run


# Muon rows whose kind of sharding a CI row already assembles (ZeRO-2's state is ZeRO-1's, HSDP's shards FSDP's,
# tp2's the TP cut of dp2 x tp2; pipeline stages and ep2 keep matrices whole): opt-in with `-m parity_matrix`.
OPT_IN = {("Muon", layout) for layout in ("dp2_zero2", "hsdp_2x2", "tp2_sp", "pp2_1f1b_tied", "moe_ep2")}


@pytest.mark.parametrize(
    ("optimizer", "layout"),
    [pytest.param(*case, marks=pytest.mark.parity_matrix) if case in OPT_IN else case for case in CASES],
)
def test_zero_layout_matches_one_process(optimizer, layout, one_process, tmp_path):
    model, nproc, extra = LAYOUTS[layout]
    reference, reference_params = one_process(optimizer, model)
    args = [*MODELS[model], *STEPS, *OPTIMIZERS[optimizer], *extra]
    records, params = train_and_read_params(args, nproc, tmp_path)
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in reference], abs=LOSS_ATOL)
    # one process holds a tied weight once; pipeline stages hold a copy each, which must equal it
    expected = {name: reference_params.get(name, reference_params.get(TIED_COPIES.get(name, ""))) for name in params}
    assert expected.keys() >= reference_params.keys()
    for name, value in expected.items():
        assert (params[name] - value).abs().max() <= PARAM_ATOL[optimizer], name
    if optimizer == "Muon" and layout in MUON_SENT_FRACTION:
        vocab = reference_params["tok_embeddings.weight"].shape[0]
        hidden = hidden_matrices(list(reference_params.items()), vocab, [], {"tok_embeddings.weight"})
        matrix_bytes = sum(reference_params[name].numel() * 4 for name in hidden)
        assert {r["optimizer_sent_bytes"] for r in records} == {MUON_SENT_FRACTION[layout] * matrix_bytes}
