"""Hugging Face tokenizers: `tokenizer.json`, the `tokenizers` library's format, as Qwen, Mistral, Gemma, DeepSeek,
OLMo, Phi and most released models ship theirs (byte-level BPE, BPE with byte fallback behind a Metaspace
pre-tokenizer, Unigram).

`model.tokenizer_path` names the `tokenizer.json` or the folder holding it; the `tokenizer_config.json` beside it,
if there is one, says which tokens are BOS and EOS and whether transformers adds them. Both are data from someone
else: read bounded (`torchpre.json_input`; the file the key names may be a link, the user's choice, a file found in
the folder is read without following one, `torchpre.confined`, a huggingface_hub cache snapshot through its blobs),
every field torchpre reads typed, and only then is the checked text handed to the library
(`tokenizers.Tokenizer.from_str`), never a path for it to open.

A text is framed as transformers frames it (`AutoTokenizer.from_pretrained(folder)(text)["input_ids"]`): the
post-processor of tokenizer.json says what is added around a text, at most one token before it (BOS) and one after.
transformers 5 follows tokenizer.json alone and 4.x the config's `add_bos_token` and `add_eos_token`, so where the
config gives them they must agree with it: the ids the model was trained with would otherwise depend on the version.
A document starts as the family starts one (its BOS where it adds one; Qwen adds none) and ends with EOS, which every
family needs to end a document. Special-token text inside a document is encoded as ordinary text, as the tiktoken
tokenizer does.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from torchpre.confined import located, read_file, read_named
from torchpre.errors import FieldError, TorchpreError, UntrustedInput, json_field
from torchpre.json_input import LIMITS, JsonValue, loads
from torchpre.optional import import_optional

if TYPE_CHECKING:
    from tokenizers import Encoding, Tokenizer

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
MODELS = ("BPE", "Unigram", "WordPiece", "WordLevel")  # the `tokenizers` library's models
MAX_ID = 2**31 - 1  # a token id; shards store ids as uint32 at most
_PROBE = "a b c"  # text any tokenizer encodes, to see what its post-processor adds around a text
_HINT = (
    "Give model.tokenizer_path (prepare: --tokenizer) a tokenizer.json as the tokenizers library writes it, or the "
    "folder of a released model holding one with its tokenizer_config.json."
)
# The library runs encode_batch on its own thread pool unless told not to: prepare's --workers decides the cores it
# uses, training ranks share the machine's, and a pool started before a fork deadlocks the child.
_PARALLELISM = "TOKENIZERS_PARALLELISM"

T = TypeVar("T")


@dataclass(frozen=True)
class TokenizerFiles:
    """The bytes a Hugging Face tokenizer is read from: tokenizer.json's and, if there is one beside it,
    tokenizer_config.json's; `path` is what model.tokenizer_path named, the sources are the files read."""

    path: Path
    tokenizer: bytes
    tokenizer_source: Path
    config: bytes | None
    config_source: Path


def read_files(path: Path) -> TokenizerFiles:
    """The files of the tokenizer `path` names: a tokenizer.json (read as the user's file: a link followed, a regular
    file), or a folder holding one (read as a folder from others: no link but a hub snapshot's into its blobs); its
    tokenizer_config.json beside it, if any, is read as a file of that folder. Each is bounded before it is read."""
    folder = path if path.is_dir() else path.parent
    try:
        if path.is_dir():
            tokenizer = read_file(*located(folder, TOKENIZER_JSON), LIMITS["tokenizer"])
        else:
            tokenizer = read_named(path, LIMITS["tokenizer"])
    except FileNotFoundError:
        what = f"{path} holds no {TOKENIZER_JSON}" if path.is_dir() else f"{path} does not exist"
        raise TorchpreError(f"Tokenizer {what}. {_HINT}") from None
    except UntrustedInput as error:
        raise UntrustedInput(f"Tokenizer {path}: {error} {_HINT}") from None
    source = folder / TOKENIZER_JSON if path.is_dir() else path
    try:
        config = read_file(*located(folder, TOKENIZER_CONFIG), LIMITS["config"])
    except FileNotFoundError:
        config = None
    except UntrustedInput as error:
        raise UntrustedInput(f"Tokenizer {path}: {error} {_HINT}") from None
    return TokenizerFiles(path, tokenizer, source, config, folder / TOKENIZER_CONFIG)


def vocabulary_size(spec: JsonValue, source: Path) -> int:
    """The number of ids of the parsed tokenizer.json `spec` (its largest id + 1: the model's embedding must have a
    row for each), once every field torchpre reads of it is shown to be of its kind: the model's type one of the
    library's, its vocabulary's ids and its added tokens' ids integers from 0 to MAX_ID, no BPE dropout (the ids
    would change from run to run)."""
    try:
        model = json_field(spec, "model", dict)
        kind = json_field(model, "type", str, "model")
        if kind not in MODELS:
            raise FieldError(f"'model.type' is {kind!r}, not one of the tokenizers library's {', '.join(MODELS)}")
        ids = _model_ids(model, kind)
        for index, token in enumerate(json_field(spec, "added_tokens", list, default=[])):
            where = f"added_tokens[{index}]"
            json_field(token, "content", str, where)
            json_field(token, "special", bool, where, default=False)
            ids.append(_token_id(token, "id", where))
    except FieldError as error:
        raise UntrustedInput(f"{source} is not a tokenizer.json torchpre can read: {error}. {_HINT}") from None
    if not ids:
        raise UntrustedInput(f"{source} holds no tokens: its model.vocab and added_tokens are empty. {_HINT}")
    return max(ids) + 1


def _model_ids(model: dict, kind: str) -> list[int]:
    """The ids of the model's vocabulary: a list of [piece, score] for Unigram (ids by position), else an object of
    token -> id."""
    if kind == "Unigram":
        pieces = json_field(model, "vocab", list, "model")
        for index, piece in enumerate(pieces):
            if not (isinstance(piece, list) and len(piece) == 2 and isinstance(piece[0], str)
                    and type(piece[1]) in (int, float)):  # fmt: skip
                raise FieldError(f"'model.vocab[{index}]' is not a [piece, score] pair")
        return list(range(len(pieces)))
    if kind == "BPE" and json_field(model, "dropout", (float, type(None)), "model", default=None):
        raise FieldError(
            f"'model.dropout' is {model['dropout']}: BPE dropout splits words at random, so the same text would give "
            "other ids each time. Set it to null"
        )
    vocab = json_field(model, "vocab", dict, "model")
    return [_token_id(vocab, token, "model.vocab") for token in vocab]


def _token_id(record: dict, key: str, where: str) -> int:
    value = json_field(record, key, int, where)
    if not 0 <= value <= MAX_ID:
        raise FieldError(f"'{where}.{key}' is {value}, not a token id (0 to {MAX_ID:,})")
    return value


@dataclass(frozen=True)
class Framing:
    """How the family frames a document: the token it starts one with (None: none), and the EOS that ends one."""

    bos_id: int | None
    eos_id: int


def framing(files: TokenizerFiles, library: Tokenizer, config: JsonValue) -> Framing:
    """The framing of the tokenizer `library` (built from `files`), whose parsed tokenizer_config.json is `config`
    ({} without one): what its post-processor adds around a text, checked against the config's BOS, EOS and
    add_bos_token / add_eos_token."""
    source, config_source = files.tokenizer_source, files.config_source
    prefix, suffix = _added_around(library, source)
    try:
        bos_named = _special_id(config, "bos_token", library, files)
        eos_named = _special_id(config, "eos_token", library, files)
        add_bos = json_field(config, "add_bos_token", (bool, type(None)), default=None)
        add_eos = json_field(config, "add_eos_token", (bool, type(None)), default=None)
    except FieldError as error:
        raise UntrustedInput(f"{config_source} is not a tokenizer_config.json torchpre can read: {error}.") from None
    _agree(files, "add_bos_token", add_bos, prefix, "before")
    _agree(files, "add_eos_token", add_eos, suffix, "after")
    for key, named, added in (("bos_token", bos_named, prefix), ("eos_token", eos_named, suffix)):
        if named is not None and added and added[0] != named:
            raise UntrustedInput(
                f"{config_source} names {key} = {library.id_to_token(named)!r} (id {named}), but the post_processor "
                f"of {source} adds {library.id_to_token(added[0])!r} (id {added[0]}): the two files describe different "
                "tokenizers. Make them agree, or use the tokenizer the model was released with."
            )
    eos_id = eos_named if eos_named is not None else (suffix[0] if suffix else None)
    if eos_id is None:
        where = f"{config_source} names no eos_token" if files.config is not None else f"it has no {TOKENIZER_CONFIG}"
        raise UntrustedInput(
            f"Tokenizer {files.path}: {where}, and its post_processor adds none: torchpre ends every document with "
            "the tokenizer's EOS token. Name it in tokenizer_config.json (\"eos_token\": \"...\"), as released "
            "models do."
        )
    return Framing(prefix[0] if prefix else None, eos_id)


def _added_around(library: Tokenizer, source: Path) -> tuple[list[int], list[int]]:
    """The ids the post-processor of tokenizer.json (`source`) adds before and after a text (at most one each), seen
    on a probe text."""
    framed = _guarded(lambda: library.encode(_PROBE, add_special_tokens=True), source, "encode a text")
    plain = _guarded(lambda: library.encode(_PROBE, add_special_tokens=False), source, "encode a text").ids
    leading = next((i for i, special in enumerate(framed.special_tokens_mask) if not special), len(framed.ids))
    prefix, rest = framed.ids[:leading], framed.ids[leading:]
    suffix = rest[len(plain) :]
    if not plain or rest[: len(plain)] != plain or len(prefix) > 1 or len(suffix) > 1:
        raise UntrustedInput(
            f"{source}: its post_processor turns the tokens {plain} of {_PROBE!r} into {framed.ids}; torchpre frames "
            "a text with at most one token before it (BOS) and one after it (EOS), as decoder-only families do. "
            f"{_HINT}"
        )
    return prefix, suffix


def _special_id(config: JsonValue, key: str, library: Tokenizer, files: TokenizerFiles) -> int | None:
    """The id of the token `config[key]` names (a string, or transformers' AddedToken object {"content": ...}), None
    when it names none; an error naming both files when tokenizer.json has no such token."""
    value = json_field(config, key, (str, dict, type(None)), default=None)
    content = json_field(value, "content", str, key) if isinstance(value, dict) else value
    if content is None:
        return None
    try:
        token_id = library.token_to_id(content)
    except UnicodeEncodeError:  # a lone surrogate ("\ud800" in the JSON), which no token holds
        token_id = None
    if token_id is None:
        raise UntrustedInput(
            f"{files.config_source}: {key} = {content!r} is not a token of {files.tokenizer_source}. Use the "
            "tokenizer_config.json released with that tokenizer.json."
        )
    return token_id


def _agree(files: TokenizerFiles, key: str, flag: bool | None, added: list[int], side: str) -> None:
    if flag is None or flag == bool(added):
        return
    does = f"adds {added} {side} every text" if added else f"adds nothing {side} a text"
    raise UntrustedInput(
        f"{files.config_source} says {key} = {str(flag).lower()}, but the post_processor of {files.tokenizer_source} "
        f"{does}: transformers 4 follows the first, transformers 5 the second, so the ids the model was trained with "
        f"are not known. Set {key} to what the model was trained with, in the file whose value is wrong."
    )


def _guarded(call: Callable[[], T], source: Path, what: str) -> T:
    """`call()` of the tokenizers library, its errors (and a panic in its Rust code, pyo3's PanicException, which is
    no Exception) an UntrustedInput naming `source`."""
    try:
        return call()
    except BaseException as error:
        if not isinstance(error, Exception) and type(error).__name__ != "PanicException":
            raise
        message = str(error).splitlines()[0][:300] if str(error) else type(error).__name__
        raise UntrustedInput(f"{source}: the tokenizers library cannot {what} with it ({message}). {_HINT}") from None


class HFTokenizer:
    """Text <-> token ids (`torchpre.data.tokenizer.Tokenizer`) of a Hugging Face tokenizer.json."""

    def __init__(self, path: str | os.PathLike) -> None:
        self._build(read_files(Path(path)))

    def _build(self, files: TokenizerFiles) -> None:
        self.path, self._files = files.path, files
        spec = loads(files.tokenizer, files.tokenizer_source)
        self.vocab_size = vocabulary_size(spec, files.tokenizer_source)
        config = {} if files.config is None else loads(files.config, files.config_source)
        tokenizers = import_optional("tokenizers", f"the Hugging Face tokenizer {files.tokenizer_source}", extra="hf")
        os.environ.setdefault(_PARALLELISM, "false")
        text = files.tokenizer.decode("utf-8")
        self._library = _guarded(lambda: tokenizers.Tokenizer.from_str(text), files.tokenizer_source, "read it")
        self._library.no_truncation()  # a document is tokenized whole
        self._library.no_padding()
        self._library.encode_special_tokens = True
        self._framing = framing(files, self._library, config)
        digest = hashlib.sha256(hashlib.sha256(files.tokenizer).digest())
        if files.config is not None:
            digest.update(hashlib.sha256(files.config).digest())
        self.sha256 = digest.hexdigest()

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def bos_id(self) -> int | None:
        return self._framing.bos_id

    @property
    def eos_id(self) -> int:
        return self._framing.eos_id

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        """Token ids of `text`, started as the family starts a document (`bos`: its BOS, where it adds one) and
        ended with EOS (`eos`)."""
        return self.encode_batch([text], bos=bos, eos=eos)[0]

    def encode_batch(self, texts: list[str], *, bos: bool, eos: bool) -> list[list[int]]:
        """`encode` for many texts at once: the library's batch encoding, on one thread unless
        TOKENIZERS_PARALLELISM says otherwise."""
        return [self._frame(encoding.ids, bos, eos) for encoding in _guarded(
            lambda: self._encodings(texts), self._source, "encode")]  # fmt: skip

    def _encodings(self, texts: list[str]) -> list[Encoding]:
        """The library's encodings of `texts`. A lone surrogate (text from JSON may hold one; no UTF-8 can) becomes
        U+FFFD first, as tiktoken makes it."""
        try:
            return self._library.encode_batch_fast(texts, add_special_tokens=False)
        except (UnicodeEncodeError, TypeError):  # the library's words for a str it cannot take as UTF-8
            valid = [text.encode("utf-16", "surrogatepass").decode("utf-16", "replace") for text in texts]
            return self._library.encode_batch_fast(valid, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens shown."""
        return _guarded(lambda: self._library.decode(list(ids), skip_special_tokens=False), self._source, "decode")

    def hf_files(self, max_length: int) -> dict[str, bytes]:
        """The files an export copies: tokenizer.json and tokenizer_config.json as read, or without a config one that
        names the EOS (and BOS) torchpre framed documents with, so that `transformers.AutoTokenizer` loads the same
        tokenizer."""
        if self._files.config is not None:
            config = self._files.config
        else:
            tokens = {"bos_token": self._token(self.bos_id), "eos_token": self._token(self.eos_id)}
            record = {"tokenizer_class": "PreTrainedTokenizerFast", **tokens, "model_max_length": max_length}
            config = json.dumps(record, indent=2).encode() + b"\n"
        return {TOKENIZER_JSON: self._files.tokenizer, TOKENIZER_CONFIG: config}

    def __getstate__(self) -> TokenizerFiles:
        """Pickled as the files' bytes (prepare's workers get the parent's tokenizer, not its path)."""
        return self._files

    def __setstate__(self, files: TokenizerFiles) -> None:
        self._build(files)

    @property
    def _source(self) -> Path:
        return self._files.tokenizer_source

    def _token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._library.id_to_token(token_id)

    def _frame(self, ids: list[int], bos: bool, eos: bool) -> list[int]:
        start = [self._framing.bos_id] if bos and self._framing.bos_id is not None else []
        return start + ids + [self._framing.eos_id] * eos
