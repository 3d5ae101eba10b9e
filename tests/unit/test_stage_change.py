"""The line a resume under another training.seq_len logs: a context-extension stage, what it keeps, and how to keep
the tokens per step instead of the sequences."""

from torchpre.checkpoint.layout import stage_change


def test_a_longer_sequence_is_a_context_extension_stage():
    line = stage_change(8192, 32768, 64, 1000)
    assert line.startswith("stage change at step 1000: training.seq_len 8192 -> 32768 (context extension).")
    assert "RoPE is computed for 32768 positions" in line
    assert "the data position is kept in sequences" in line
    assert "64 sequences = 2097152 tokens per step" in line
    assert "set training.global_batch_size = 16 to keep 524288 tokens per step" in line


def test_the_same_or_an_unrecorded_length_is_no_stage_change():
    assert stage_change(2048, 2048, 8, 5) is None
    assert stage_change(None, 4096, 8, 5) is None  # a checkpoint saved before the length was recorded
    assert "no whole number of 40-token sequences" in stage_change(32, 40, 3, 5)
