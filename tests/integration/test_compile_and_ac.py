"""Activation checkpointing and torch.compile change no numbers (beyond compiler reduction order)."""

import shutil

import pytest

from tests.launch import TINY, train_and_read_metrics

pytestmark = pytest.mark.slow

STEPS = ["--training.steps", "6"]


def losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records]


@pytest.fixture(scope="module")
def eager(tmp_path_factory) -> list[dict]:
    return train_and_read_metrics([*TINY, *STEPS], 1, tmp_path_factory.mktemp("eager"))


@pytest.mark.parametrize("mode, option", [("full", "op"), ("selective", "op"), ("selective", "2")])
def test_activation_checkpointing_is_exact(mode, option, eager, tmp_path):
    """Recomputation replays the same deterministic fp32 CPU kernels: identical losses and norms."""
    args = ["--activation_checkpoint.mode", mode, "--activation_checkpoint.selective_ac_option", option]
    records = train_and_read_metrics([*TINY, *STEPS, *args], 1, tmp_path)
    assert losses(records) == losses(eager)
    assert [r["grad_norm"] for r in records] == [r["grad_norm"] for r in eager]


def test_checkpoint_saved_with_ac_resumes_without_it(eager, tmp_path):
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "3"]
    train_and_read_metrics([*TINY, *STEPS, *ckpt, "--activation_checkpoint.mode", "full"], 1, tmp_path)
    shutil.rmtree(tmp_path / "checkpoint" / "step-6")
    (tmp_path / "metrics.jsonl").unlink()
    resumed = train_and_read_metrics([*TINY, *STEPS, *ckpt], 1, tmp_path)
    assert losses(resumed) == losses(eager)[3:]


# Inductor fuses and reorders reductions (RMSNorm, softmax, the loss): fp32 rounding differences
# of ~1e-6 relative per step that Adam carries forward; 1e-4 on a loss of ~8 is far below any bug.
COMPILE_ATOL = 1e-4


def test_compiled_blocks_and_loss_match_eager(eager, tmp_path):
    records = train_and_read_metrics([*TINY, *STEPS, "--compile.enable"], 1, tmp_path)
    assert losses(records) == pytest.approx(losses(eager), abs=COMPILE_ATOL)


def test_compile_composes_with_dp_ac_and_zero1(eager, tmp_path):
    args = [
        "--compile.enable", "--activation_checkpoint.mode", "selective",
        "--training.local_batch_size", "2", "--optimizer.zero_stage", "1",
    ]
    records = train_and_read_metrics([*TINY, *STEPS, *args], 2, tmp_path)
    assert losses(records) == pytest.approx(losses(eager), abs=COMPILE_ATOL)


def test_compile_composes_with_tensor_and_sequence_parallel(eager, tmp_path):
    """Under TP the block's children compile separately (see compile_blocks); the loss stays eager
    under loss parallel."""
    args = [
        "--compile.enable", "--parallelism.tensor_parallel_degree", "2",
        "--parallelism.enable_sequence_parallel", "--parallelism.enable_loss_parallel",
    ]
    records = train_and_read_metrics([*TINY, *STEPS, *args], 2, tmp_path)
    assert losses(records) == pytest.approx(losses(eager), abs=COMPILE_ATOL)


# The tiny model's 2 blocks with the embedding and the output counted as a layer each, over pp2 x 2 interleaved stages:
# each rank holds a part with no block (the embedding alone on rank 0, the output alone on rank 1), which activation
# checkpointing and compile leave as it is.
EMBEDDING_AND_OUTPUT_ALONE = [
    "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
    "--parallelism.pipeline_parallel_virtual_stages", "2",
    "--parallelism.pipeline_parallel_embedding_layers", "1", "--parallelism.pipeline_parallel_output_layers", "1",
    "--activation_checkpoint.mode", "full",
]  # fmt: skip


@pytest.mark.parametrize("split", [["--parallelism.pipeline_parallel_schedule", "1F1B"], EMBEDDING_AND_OUTPUT_ALONE],
                         ids=["1f1b", "embedding_and_output_alone"])  # fmt: skip
def test_compile_composes_with_pipeline_parallel(split, eager, tmp_path):
    args = ["--compile.enable", "--parallelism.pipeline_parallel_degree", "2", *split]
    records = train_and_read_metrics([*TINY, *STEPS, *args], 2, tmp_path)
    assert losses(records) == pytest.approx(losses(eager), abs=COMPILE_ATOL)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_compile_composes_with_tensor_parallel_and_activation_checkpointing(mode, eager, tmp_path):
    """The standard large-model setting: under TP each block's children compile on their own, also inside the
    activation-checkpoint wrapper (whose only child would otherwise be compiled as one whole-block graph, which
    fails in backward)."""
    args = [
        "--compile.enable", "--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_sequence_parallel",
        "--activation_checkpoint.mode", mode,
    ]
    records = train_and_read_metrics([*TINY, *STEPS, *args], 2, tmp_path)
    assert losses(records) == pytest.approx(losses(eager), abs=COMPILE_ATOL)
