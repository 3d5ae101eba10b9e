"""The tiktoken BPE tokenizer used by Llama 3, loadable from any file in its format.

A tiktoken file holds one `base64(token) rank` line per mergeable token (Meta's Llama 3
`tokenizer.model`, or the small one shipped in `assets/tokenizer/`). Special tokens are not in the
file: they take the ids right after the ranks. A real Llama 3 file (128000 ranks) gets Meta's 256
special tokens so that ids match Meta's checkpoints; any other file gets just BOS and EOS.
"""

import base64
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import tiktoken

from torchpre.confined import read_named, write_file
from torchpre.errors import TorchpreError, UntrustedInput
from torchpre.json_input import LIMITS

DEFAULT_TOKENIZER_PATH = Path(__file__).resolve().parents[2] / "assets" / "tokenizer" / "tokenizer.model"

# Llama 3's pre-split regex: contractions, words, numbers of up to 3 digits, punctuation, spaces.
LLAMA3_PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
_LLAMA3_NUM_RANKS = 128_000
_LLAMA3_NUM_SPECIAL_TOKENS = 256
_FORMAT_HINT = (
    "Set model.tokenizer_path to a tiktoken BPE file: one 'base64token rank' line per token, "
    "ranks 0..N-1, all 256 single bytes present (e.g. Llama 3's original/tokenizer.model, "
    f"or the default {DEFAULT_TOKENIZER_PATH}); or to a Hugging Face tokenizer.json, or the folder holding it "
    "(a SentencePiece tokenizer.model is read through its folder's tokenizer.json)."
)


def llama3_special_tokens() -> list[str]:
    """Meta's Llama 3 special tokens, in id order from 128000 (as in Meta's llama3 tokenizer.py)."""
    named = [
        BOS,
        EOS,
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|reserved_special_token_2|>",
        "<|reserved_special_token_3|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|reserved_special_token_4|>",
        "<|eot_id|>",
    ]
    reserved = range(5, _LLAMA3_NUM_SPECIAL_TOKENS - 5)
    return named + [f"<|reserved_special_token_{i}|>" for i in reserved]


def load_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """Read and validate a tiktoken BPE file."""
    path = Path(path)
    return parse_ranks(_read(path), path)


def parse_ranks(data: bytes, path: Path) -> dict[bytes, int]:
    """The ranks of the tiktoken file `path`, whose bytes are `data`, validated.

    Parsed here rather than with `tiktoken.load.load_tiktoken_bpe`, which caches files by path in
    a temp dir (so a re-trained file at the same path would load stale) and gives no line numbers.
    """
    ranks: dict[bytes, int] = {}
    for line_number, line in enumerate(data.splitlines(), start=1):
        if line.strip():
            token, rank = _parse_line(line, f"{path}:{line_number}")
            ranks[token] = rank
    _check_ranks(ranks, path)
    return ranks


def _read(path: Path) -> bytes:
    """The bytes of the tokenizer file `path`: tokenizer files are downloaded, and read whole, so it must be a
    regular file of at most `LIMITS["tiktoken"]` bytes (the path is the user's: a link on it is followed,
    `confined.read_named`)."""
    try:
        return read_named(path, LIMITS["tiktoken"])
    except FileNotFoundError:
        raise TorchpreError(f"Tokenizer file {path} does not exist. {_FORMAT_HINT}") from None
    except UntrustedInput as error:
        raise UntrustedInput(f"Tokenizer file {path}: {error} {_FORMAT_HINT}") from None


def save_ranks(ranks: dict[bytes, int], path: str | os.PathLike) -> None:
    """Write ranks in the format `load_ranks` reads, in rank order (a new file renamed into place)."""
    by_rank = sorted(ranks.items(), key=lambda item: item[1])
    write_file(Path(path), b"".join(base64.b64encode(t) + b" %d\n" % r for t, r in by_rank))


def _parse_line(line: bytes, where: str) -> tuple[bytes, int]:
    """A `base64token rank` line: two fields, the token valid base64, the rank at most 10 ASCII digits."""
    try:
        token, rank = line.split()
        if not rank.isdigit() or len(rank) > 10:
            raise ValueError("the rank is not a number of at most 10 digits")
        return base64.b64decode(token, validate=True), int(rank)
    except ValueError:  # also raised for bad base64 (binascii.Error)
        raise TorchpreError(f"Malformed line {where}: {line[:80]!r}. {_FORMAT_HINT}") from None


def _check_ranks(ranks: dict[bytes, int], path: Path) -> None:
    """tiktoken needs ranks 0..N-1, one per token, and every byte encodable."""
    if not ranks:
        raise TorchpreError(f"Tokenizer file {path} holds no tokens. {_FORMAT_HINT}")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TorchpreError(
            f"Tokenizer file {path} has duplicate tokens, or ranks other than "
            f"0..{len(ranks) - 1}. {_FORMAT_HINT}"
        )
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TorchpreError(
            f"Tokenizer file {path} lacks {len(missing)} single-byte tokens (e.g. byte "
            f"{missing[0]}), so some text could not be encoded. {_FORMAT_HINT}"
        )


def _special_tokens(num_ranks: int) -> dict[str, int]:
    names = llama3_special_tokens() if num_ranks == _LLAMA3_NUM_RANKS else [BOS, EOS]
    return {name: num_ranks + i for i, name in enumerate(names)}


class TiktokenTokenizer:
    """Text <-> token ids (`torchpre.data.tokenizer.Tokenizer`). Special-token text in the input is encoded as
    ordinary text. Every text is framed BOS ... EOS as Llama 3 frames it."""

    def __init__(self, path: str | os.PathLike) -> None:
        self._build(Path(path), _read(Path(path)))

    def _build(self, path: Path, data: bytes) -> None:
        self.path, self._data = path, data
        self.sha256 = hashlib.sha256(data).hexdigest()
        ranks = parse_ranks(data, path)
        self.special_tokens = _special_tokens(len(ranks))
        self._encoding = tiktoken.Encoding(
            name=path.name, pat_str=LLAMA3_PAT_STR, mergeable_ranks=ranks, special_tokens=self.special_tokens
        )
        self._bos_id = self.special_tokens[BOS]
        self._eos_id = self.special_tokens[EOS]

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included: the model's embedding size must cover it."""
        return self._encoding.n_vocab

    @property
    def bos_id(self) -> int:
        return self._bos_id

    @property
    def eos_id(self) -> int:
        return self._eos_id

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        """Token ids of `text`, optionally framed by BOS/EOS."""
        return self._frame(self._encoding.encode_ordinary(text), bos, eos)

    def encode_batch(self, texts: list[str], *, bos: bool, eos: bool) -> list[list[int]]:
        """`encode` for many texts at once, on tiktoken's thread pool."""
        return [self._frame(ids, bos, eos) for ids in self._encoding.encode_ordinary_batch(texts)]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; bytes that are not valid UTF-8 become U+FFFD."""
        return self._encoding.decode(list(ids))

    def hf_files(self, max_length: int) -> dict[str, bytes]:
        """The file as `tokenizer.model` and a `tokenizer_config.json` with which `transformers.AutoTokenizer` loads
        it (transformers converts a tiktoken file itself): the same ids, BOS prepended, special tokens by their
        ids."""
        added = {
            str(token_id): {
                "content": name, "special": True, "lstrip": False, "rstrip": False, "normalized": False,
                "single_word": False,
            }
            for name, token_id in self.special_tokens.items()
        }
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "add_bos_token": True,
            "add_eos_token": False,
            "model_max_length": max_length,
            "added_tokens_decoder": added,
        }
        return {"tokenizer.model": self._data, "tokenizer_config.json": json.dumps(config, indent=2).encode() + b"\n"}

    def __getstate__(self) -> dict:
        """Pickled as the file's bytes (prepare's workers get the parent's tokenizer, not its path)."""
        return {"path": self.path, "data": self._data}

    def __setstate__(self, state: dict) -> None:
        self._build(state["path"], state["data"])

    def _frame(self, ids: list[int], bos: bool, eos: bool) -> list[int]:
        return [self._bos_id] * bos + ids + [self._eos_id] * eos
