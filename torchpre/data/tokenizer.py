"""Text <-> token ids for every entry point: what a tokenizer offers (`Tokenizer`) and which one a path names
(`load_tokenizer`): a Hugging Face `tokenizer.json` or the folder holding it (`torchpre.data.hf_tokenizer`), else a
tiktoken BPE file such as Llama 3's `original/tokenizer.model` or the small one shipped in `assets/tokenizer/`
(`torchpre.data.tiktoken_bpe`), the default."""

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from torchpre.data.hf_tokenizer import HFTokenizer
from torchpre.data.tiktoken_bpe import DEFAULT_TOKENIZER_PATH, TiktokenTokenizer

__all__ = ["DEFAULT_TOKENIZER_PATH", "Tokenizer", "load_tokenizer"]


class Tokenizer(Protocol):
    """A tokenizer as torchpre uses it: documents are encoded framed as the family frames them (`bos`: its BOS where
    it starts documents with one, `eos`: the EOS that ends one), and `sha256` identifies the files it was read from,
    so that pre-tokenized shards are used only with the tokenizer that made them."""

    path: Path  # what model.tokenizer_path named
    sha256: str

    @property
    def name(self) -> str: ...

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included: the model's embedding must have a row for each."""

    @property
    def bos_id(self) -> int | None:
        """The token every document starts with; None for a family that starts documents with none (Qwen)."""

    @property
    def eos_id(self) -> int: ...

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]: ...

    def encode_batch(self, texts: list[str], *, bos: bool, eos: bool) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def hf_files(self, max_length: int) -> dict[str, bytes]:
        """The tokenizer files of a Hugging Face export (name -> bytes), which `transformers.AutoTokenizer` loads
        to the same ids."""


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer at `path`: a folder or a `.json` file is a Hugging Face tokenizer, anything else a tiktoken
    file."""
    path = Path(path)
    if path.is_dir() or path.suffix == ".json":
        return HFTokenizer(path)
    return TiktokenTokenizer(path)
