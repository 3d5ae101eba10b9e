"""training.document_mask: the Llama model attends within documents only (checked against running each
document on its own), and training with it runs, changes the loss, and is layout-invariant under TP + SP,
activation checkpointing and compile."""

import dataclasses

import pytest
import torch

from tests.launch import TINY, short_documents_args, train_and_read_metrics
from torchpre.models.llama3.args import LLAMA3_FLAVORS
from torchpre.models.llama3.model import Transformer

ARGS = dataclasses.replace(LLAMA3_FLAVORS["tiny"], vocab_size=64, max_seq_len=16)
# Row 0: the tail of a document from an earlier row, then two documents; row 1: one document.
DOCUMENT_IDS = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2], [0] * 16])
# A document run on its own sits at RoPE positions 0.. instead of its offset in the row. RoPE makes
# attention scores depend on position differences only, so the outputs agree up to the fp32 rounding
# of other rotation angles (~1e-7 per score), which two layers leave far below 1e-5.
ROPE_OFFSET_ATOL = 1e-5


@pytest.fixture(scope="module")
def model() -> Transformer:
    with torch.device("meta"):
        model = Transformer(ARGS)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model


def test_document_mask_equals_each_document_run_alone(model):
    tokens = torch.randint(0, ARGS.vocab_size, DOCUMENT_IDS.shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(tokens, document_ids=DOCUMENT_IDS)
        for row, ids in enumerate(DOCUMENT_IDS):
            for document in ids.unique():
                part = ids == document
                alone = model(tokens[row : row + 1, part])
                torch.testing.assert_close(logits[row : row + 1, part], alone, rtol=0, atol=ROPE_OFFSET_ATOL)
        assert not torch.allclose(logits, model(tokens)), "the mask changed nothing"


def test_document_ids_with_a_kv_cache_position_is_rejected(model):
    with pytest.raises(ValueError, match="start_pos"):
        model(torch.zeros(1, 4, dtype=torch.long), start_pos=0, document_ids=torch.zeros(1, 4, dtype=torch.long))


# End to end ----------------------------------------------------------------------------------------

STEPS = ["--training.steps", "4"]
MASK = ["--training.document_mask"]
# fp32 on CPU: TP, SP and compile reorder reductions (~1e-6 relative per step, carried by Adam);
# 1e-4 on a loss of ~8 is far below any masking or sharding bug.
LOSS_ATOL = 1e-4


def losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records]


@pytest.fixture(scope="module")
def packed_args(tmp_path_factory) -> list[str]:
    return [*TINY, *STEPS, *short_documents_args(tmp_path_factory.mktemp("data"))]


@pytest.fixture(scope="module")
def masked(packed_args, tmp_path_factory) -> list[float]:
    return losses(train_and_read_metrics([*packed_args, *MASK], 1, tmp_path_factory.mktemp("masked")))


@pytest.mark.slow
def test_document_mask_changes_the_loss(packed_args, masked, tmp_path):
    """A freshly initialized model barely uses its context, so the effect is small and depends on the boundaries
    each step's batch holds (6e-5 to 1.4e-3 a step here), but it is deterministic and, over the run, above the
    tolerance the layout comparisons below allow."""
    unmasked = losses(train_and_read_metrics(packed_args, 1, tmp_path))
    effects = [abs(a - b) for a, b in zip(masked, unmasked)]
    assert sum(effects) / len(effects) > LOSS_ATOL and max(effects) > 5 * LOSS_ATOL, (masked, unmasked)


@pytest.mark.slow
def test_document_mask_under_tp_sp_and_ac_matches_one_process(packed_args, masked, tmp_path):
    """Every TP rank builds the same full-sequence mask from the full inputs; under SP attention
    gathers the whole sequence, which is what the mask covers."""
    args = [
        "--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_sequence_parallel",
        "--activation_checkpoint.mode", "selective",
    ]
    records = train_and_read_metrics([*packed_args, *MASK, *args], 2, tmp_path)
    assert losses(records) == pytest.approx(masked, abs=LOSS_ATOL)


@pytest.mark.slow
def test_document_mask_under_context_parallel_matches_one_process(packed_args, masked, tmp_path):
    """Each cp rank holds half of every row (head-tail); the document ids come from the whole rows, gathered over
    cp, so a document that crosses the chunk boundaries stays one document (measured: within 1e-6 of one process;
    the reorder is that of the key/value gradient sums alone, so 1e-5 here)."""
    records = train_and_read_metrics([*packed_args, *MASK, "--parallelism.context_parallel_degree", "2"], 2, tmp_path)
    assert losses(records) == pytest.approx(masked, abs=1e-5)


@pytest.mark.slow
def test_document_mask_compiled_matches_eager(packed_args, masked, tmp_path):
    records = train_and_read_metrics([*packed_args, *MASK, "--compile.enable"], 1, tmp_path)
    assert losses(records) == pytest.approx(masked, abs=LOSS_ATOL)
