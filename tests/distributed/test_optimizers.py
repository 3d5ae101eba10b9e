"""Optimizers other than AdamW under ZeRO: their state sharded over DP (and cut within TP shards) trains like the
replicated state and like one process. Their checkpoints' round trip under resharding is in the reshard matrix
(tests/reshard_matrix.py, axis `optimizer`)."""

import pytest

from tests.launch import TINY, train_and_read_params

pytestmark = pytest.mark.slow

# fp32 on CPU: ZeRO-1 changes only where each update is computed (a shard per rank) and how gradients are summed
# (reduce-scatter instead of all-reduce), TP the order of the sharded matmuls' sums: reduction-order noise,
# ~1e-7 per operation. A lost momentum buffer, a shard stepped twice or a wrong chunk moves losses and
# parameters by far more than 1e-5 within a step or two at these learning rates.
LOSS_ATOL = 1e-5
PARAM_ATOL = 1e-5

STEPS = ["--training.steps", "5"]
OPTIMIZERS = {
    "SGD": ["--optimizer.name", "SGD", "--optimizer.momentum", "0.9", "--optimizer.lr", "0.05"],
    "RMSprop": ["--optimizer.name", "RMSprop", "--optimizer.momentum", "0.5", "--optimizer.lr", "0.002"],
}
DP2 = ["--training.local_batch_size", "4"]  # the one-process run's 8 sequences a step, over 2 ranks
LAYOUTS = {
    "dp2_zero0": (2, [*DP2, "--optimizer.zero_stage", "0"]),
    "dp2_zero1": (2, [*DP2, "--optimizer.zero_stage", "1"]),
    "dp2_tp2_zero1": (4, [*DP2, "--optimizer.zero_stage", "1", "--parallelism.tensor_parallel_degree", "2"]),
}


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_zero_layouts_match_one_process(optimizer, tmp_path):
    args = [*TINY, *STEPS, *OPTIMIZERS[optimizer]]
    reference, reference_params = train_and_read_params([*args, "--training.local_batch_size", "8"], 1, tmp_path / "1")
    assert reference[-1]["loss"] < reference[0]["loss"] - 0.01, "the optimizer did not train: nothing to compare"
    for layout, (nproc, extra) in LAYOUTS.items():
        records, params = train_and_read_params([*args, *extra], nproc, tmp_path / layout)
        losses = [r["loss"] for r in records]
        assert losses == pytest.approx([r["loss"] for r in reference], abs=LOSS_ATOL), layout
        assert params.keys() == reference_params.keys()
        for name, value in reference_params.items():
            assert (params[name] - value).abs().max() <= PARAM_ATOL, f"{layout}: {name}"
