"""Per-position inputs a model's forward gets besides the tokens, built from whole rows so that every layout (a
pipeline's microbatches, context parallelism's cut of the positions) hands each position the same values."""

import torch
from torch import Tensor

IGNORE_INDEX = -100
"""A position past the end of its row (F.cross_entropy's default ignore_index)."""


def future_tokens(inputs: Tensor, columns: int) -> Tensor:
    """[batch, seq] token ids -> [batch, seq, columns]: entry (b, i, j) is inputs[b, i + j + 1], the token j + 1
    positions ahead (multi-token prediction's inputs and targets), or `IGNORE_INDEX` past the row's end."""
    ahead = torch.full((*inputs.shape, columns), IGNORE_INDEX, dtype=inputs.dtype, device=inputs.device)
    seq_len = inputs.shape[1]
    for j in range(min(columns, seq_len - 1)):
        ahead[:, : seq_len - j - 1, j] = inputs[:, j + 1 :]
    return ahead
