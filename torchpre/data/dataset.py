"""Packed next-token-prediction samples cut from one token stream."""

import torch
from torch.utils.data import Dataset

from torchpre.data.tokenizer import Tokenizer


def pack_documents(documents: list[str], tokenizer: Tokenizer) -> torch.Tensor:
    """Tokenizes every document as BOS + text + EOS (text + EOS for a family without a BOS) and concatenates them
    into one 1-D stream."""
    encoded = tokenizer.encode_batch(documents, bos=True, eos=True)
    return torch.tensor([token for ids in encoded for token in ids], dtype=torch.int64)


class PackedWindows(Dataset):
    """Sample i is the window tokens[i*(seq_len+1) : (i+1)*(seq_len+1)], split into input and labels.

    Windows do not overlap, so every token is trained on once per epoch; documents are packed back
    to back and a window may span a document boundary (separated by EOS/BOS), as in Llama pretraining.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        self.seq_len = seq_len
        self.num_windows = tokens.numel() // (seq_len + 1)
        self.windows = tokens[: self.num_windows * (seq_len + 1)].view(self.num_windows, seq_len + 1)

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.windows[index]
        return window[:-1], window[1:]
