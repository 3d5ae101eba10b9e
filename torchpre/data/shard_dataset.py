"""Training samples read straight from a pre-tokenized shard folder, a window at a time."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from torchpre.data.shards import ShardReader, out_of_vocabulary
from torchpre.errors import TorchpreError


class ShardWindows(Dataset):
    """Sample i is the window stream[i*(seq_len+1) : (i+1)*(seq_len+1)] of the folder's token stream,
    split into input and labels; the stream is the folder's shards concatenated in manifest order.

    So the samples are exactly `PackedWindows` over the same documents packed in memory: windows do
    not overlap, may span a document boundary and also a shard boundary (no tokens are dropped at
    shard ends; only the stream's last partial window is). A window is located by a binary search in
    the shards' cumulative token counts and only its own seq_len+1 tokens are read.

    Every window is checked against `vocab_size`, the rows of the model's embedding (the manifest's claim is
    checked against it too, by `ShardReader`): an id past them is an error naming the shard file and offset, never
    an IndexError mid-run.
    """

    def __init__(self, folder: str, seq_len: int, tokenizer_sha256: str, vocab_size: int):
        self.folder = folder
        self.seq_len = seq_len
        self.tokenizer_sha256 = tokenizer_sha256
        self.reader = ShardReader(folder, vocab_size, expected_tokenizer_sha256=tokenizer_sha256)
        counts = [shard.num_tokens for shard in self.reader.shards]
        self.shard_starts = np.concatenate(([0], np.cumsum(counts, dtype=np.int64)))
        self.num_tokens = int(self.shard_starts[-1])
        self.num_windows = self.num_tokens // (seq_len + 1)

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.num_windows:
            raise IndexError(f"window {index} of {self.num_windows}")
        start = index * (self.seq_len + 1)
        window = torch.from_numpy(self.tokens(start, self.seq_len + 1))
        if int(window.max()) >= self.reader.vocab_size:  # cheap next to a step; shards from before max ids
            self._out_of_vocabulary(start, window)
        return window[:-1], window[1:]

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A batch of windows (the loader asks for a batch at once): the kernel is first asked to read every window
        of it ahead (`ShardReader.will_need`), so that the reads of a batch not yet in the page cache overlap; about
        twice the cold rate of reading them in turn (`python -m bench.data_scale --only cold`)."""
        for index in indices:
            if 0 <= index < self.num_windows:
                self._will_need(index * (self.seq_len + 1), self.seq_len + 1)
        return [self[index] for index in indices]

    def _will_need(self, start: int, count: int) -> None:
        shard = int(np.searchsorted(self.shard_starts, start, side="right")) - 1
        while count > 0:
            offset = start - int(self.shard_starts[shard])
            part = min(count, self.reader.shards[shard].num_tokens - offset)
            if part > 0:
                self.reader.will_need(shard, offset, part)
            start, count, shard = start + max(part, 0), count - max(part, 0), shard + 1

    def _out_of_vocabulary(self, start: int, window: torch.Tensor) -> None:
        position = start + int(torch.nonzero(window >= self.reader.vocab_size)[0])
        shard = int(np.searchsorted(self.shard_starts, position, side="right")) - 1
        path = self.reader.folder / f"{self.reader.shards[shard].name}.bin"
        offset, token_id = position - int(self.shard_starts[shard]), int(window[position - start])
        where = f"at token offset {offset:,} holds"
        raise TorchpreError(out_of_vocabulary(path, token_id, self.reader.vocab_size, where))

    def tokens(self, start: int, count: int) -> np.ndarray:
        """`count` tokens of the stream from `start`, as int64, read across shard ends as needed."""
        parts = []
        shard = int(np.searchsorted(self.shard_starts, start, side="right")) - 1
        while count > 0:
            offset = start - int(self.shard_starts[shard])
            part = self.reader.read(shard, offset, count)
            parts.append(part)
            start, count, shard = start + len(part), count - len(part), shard + 1
        return np.concatenate(parts).astype(np.int64)

    def __getstate__(self) -> dict[str, Any]:
        """DataLoader workers started by spawn/forkserver get the folder, not the reader: its open descriptors
        are this process's."""
        names = ("folder", "seq_len", "tokenizer_sha256")
        return {name: getattr(self, name) for name in names} | {"vocab_size": self.reader.vocab_size}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)
