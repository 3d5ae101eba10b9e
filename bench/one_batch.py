"""A dataset of exactly one global batch of real text, so that every step of a coordinate check trains on the same
batch (as the `mup` package's check does) and that batch is also the probe."""

import json
from pathlib import Path

import torch

from torchpre.data.corpus import stdlib_documents
from torchpre.data.dataset import PackedWindows, pack_documents
from torchpre.data.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer

BATCH, SEQ_LEN = 8, 64  # one global batch, trained on at every step


def fixed_batch(
    folder: Path, batch: int = BATCH, seq_len: int = SEQ_LEN
) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """train.py's data flags for a dataset of exactly one global batch (`batch` windows of `seq_len` + 1 tokens: lines
    of the standard library's docstrings, each shorter than a window), so that every step trains on the same batch,
    as the `mup` package's coordinate check does; and that batch's inputs (the probe) and labels [batch, seq_len]."""
    tokenizer, lines, total = load_tokenizer(DEFAULT_TOKENIZER_PATH), [], 0
    for line in (line.strip() for document in stdlib_documents() for line in document.splitlines()):
        size = len(tokenizer.encode(line, bos=True, eos=True))
        if line and size <= seq_len:
            lines.append(line)
            total += size
        if total >= batch * (seq_len + 1):
            break
    path = folder / "one_batch.jsonl"
    path.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    windows = PackedWindows(pack_documents(lines, tokenizer), seq_len)
    inputs, labels = (torch.stack(column) for column in zip(*(windows[i] for i in range(len(windows)))))
    flags = ["--training.dataset", "text", "--training.dataset_path", str(path),
             "--training.seq_len", str(seq_len), "--training.local_batch_size", str(batch)]  # fmt: skip
    return flags, inputs, labels
