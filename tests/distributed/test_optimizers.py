"""Optimizers other than AdamW under ZeRO: their state sharded over DP (and cut within TP shards) trains like the
replicated state and like one process. Their checkpoints' round trip under resharding is in the reshard matrix
(tests/reshard_matrix.py, axis `optimizer`)."""

from collections.abc import Callable

import pytest

from tests.launch import TINY, train_and_read_params

pytestmark = pytest.mark.slow

# fp32 on CPU: ZeRO-1 changes only where each update is computed (a shard per rank) and how gradients are summed
# (reduce-scatter instead of all-reduce), TP the order of the sharded matmuls' sums: reduction-order noise,
# ~1e-7 per operation. A lost momentum buffer, a shard stepped twice or a wrong chunk moves losses and
# parameters by far more than 1e-5 within a step or two at these learning rates.
LOSS_ATOL = 1e-5
# RMSprop divides by the root of its squared-gradient average, which is tiny where an element's gradients are,
# so that reduction noise reaches the parameters larger: measured 2.5e-6 on an idle machine, 1.2e-5 once in CI.
PARAM_ATOL = {"SGD": 1e-5, "RMSprop": 3e-5}

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


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Callable[[str], tuple[list[dict], dict]]:
    """Per optimizer, the one-process run's records and final parameters, trained on first use."""
    runs: dict[str, tuple[list[dict], dict]] = {}

    def run(optimizer: str) -> tuple[list[dict], dict]:
        if optimizer not in runs:
            folder = tmp_path_factory.mktemp(optimizer)
            one = [*TINY, *STEPS, *OPTIMIZERS[optimizer], "--training.local_batch_size", "8"]
            records, params = train_and_read_params(one, 1, folder / "trained")
            # Over 5 steps the loss moves less than from one batch to the next; that the optimizer moved the
            # parameters (so that comparing them means something) shows against the same run at a learning rate
            # of ~0.
            _, frozen = train_and_read_params([*one, "--optimizer.lr", "1e-12"], 1, folder / "frozen")
            moved = max((params[name] - value).abs().max().item() for name, value in frozen.items())
            assert moved > 100 * PARAM_ATOL[optimizer], f"{optimizer} moved the parameters by {moved} only"
            runs[optimizer] = records, params
        return runs[optimizer]

    return run


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_zero_layout_matches_one_process(optimizer, layout, one_process, tmp_path):
    reference, reference_params = one_process(optimizer)
    nproc, extra = LAYOUTS[layout]
    records, params = train_and_read_params([*TINY, *STEPS, *OPTIMIZERS[optimizer], *extra], nproc, tmp_path)
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in reference], abs=LOSS_ATOL)
    assert params.keys() == reference_params.keys()
    for name, value in reference_params.items():
        assert (params[name] - value).abs().max() <= PARAM_ATOL[optimizer], name
