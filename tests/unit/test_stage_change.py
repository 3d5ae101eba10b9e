"""The line a resume under another training.seq_len or RoPE logs: a context-extension stage, what changed, what it
keeps of the global batch, and how to keep the tokens per step instead of the sequences."""

from torchpre.checkpoint.layout import stage_change
from torchpre.training.batches import kept_global_batch

ROPE = {"rope_theta": 500000.0, "rope_scaling_factor": 0.0, "rope_low_freq_factor": 0.0,
        "rope_high_freq_factor": 0.0, "rope_original_max_seq_len": 0.0}  # fmt: skip


def test_a_longer_sequence_is_a_context_extension_stage():
    line = stage_change({"seq_len": 8192}, {"seq_len": 32768}, 64, 1000, "sequences")
    assert line.startswith("stage change at step 1000: training.seq_len 8192 -> 32768 (context extension).")
    assert "RoPE is computed for 32768 positions" in line
    assert "the data position is kept in sequences" in line
    assert "64 sequences = 2097152 tokens per step" in line
    assert "set training.global_batch_unit = 'tokens' to keep 524288 tokens per step as 16 sequences" in line


def test_a_changed_rope_is_listed_with_the_sequence_length():
    saved, current = {"seq_len": 32, **ROPE}, {"seq_len": 64, **ROPE, "rope_theta": 2e6}
    current |= {"rope_scaling_factor": 4.0, "rope_low_freq_factor": 1.0}
    line = stage_change(saved, current, 2, 4, "tokens")
    assert line.startswith(
        "stage change at step 4: training.seq_len 32 -> 64, model.rope_theta 500000 -> 2000000, "
        "model.rope_scaling_factor off -> 4, model.rope_low_freq_factor off -> 1 (context extension)."
    )
    assert "2 sequences = 128 tokens per step (training.global_batch_unit = 'tokens' kept" in line
    assert stage_change(saved | {"seq_len": 64}, current, 2, 4, "sequences").endswith("(new RoPE).")


def test_the_same_or_an_unrecorded_stage_is_no_stage_change():
    assert stage_change({"seq_len": 2048, **ROPE}, {"seq_len": 2048, **ROPE}, 8, 5, "sequences") is None
    assert stage_change({}, {"seq_len": 4096, **ROPE}, 8, 5, "sequences") is None  # saved before it was recorded
    assert "no whole number of 40-token sequences" in stage_change({"seq_len": 32}, {"seq_len": 40}, 3, 5, "sequences")


def test_the_kept_global_batch_in_sequences_or_tokens():
    assert kept_global_batch(4, 32, 64, "sequences") == 4
    assert kept_global_batch(4, 32, 64, "tokens") == 2
    assert kept_global_batch(4, 32, 96, "tokens") is None  # 128 tokens are no whole number of 96-token sequences
    assert kept_global_batch(4, 64, 64, "tokens") == 4
