"""The tiktoken tokenizer, its file format and errors, and the BPE trainer of the shipped file."""

import hashlib
import random
import re
from collections import Counter

import pytest
import regex
import tiktoken

from torchpre.data.bpe import train_bpe
from torchpre.data.tiktoken_bpe import (
    DEFAULT_TOKENIZER_PATH,
    LLAMA3_PAT_STR,
    TiktokenTokenizer,
    llama3_special_tokens,
    load_ranks,
    save_ranks,
)
from torchpre.data.tokenizer import load_tokenizer
from torchpre.errors import TorchpreError

TEXTS = [
    "",
    "Hello, world!",
    "  leading, trailing and   inner spaces  \n\n\t tabs\t",
    "def square(x: int) -> int:\n    return x ** 2  # the square\n",
    "naïve café — 日本語のテキスト, Ελληνικά, emoji 🤖👍🏽",
    "numbers 1234567 and 3.14159, dates 2024-05-01",
    "windows\r\nline endings\r\n",
    "<|begin_of_text|> and <|end_of_text|> typed by a user",
]
BYTE_RANKS = {bytes([b]): b for b in range(256)}


@pytest.fixture(scope="module")
def tokenizer() -> TiktokenTokenizer:
    return TiktokenTokenizer(DEFAULT_TOKENIZER_PATH)


def test_shipped_tokenizer_has_2048_ids(tokenizer):
    assert tokenizer.vocab_size == 2048
    assert (tokenizer.bos_id, tokenizer.eos_id) == (2046, 2047)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tokenizer, text):
    ids = tokenizer.encode(text, bos=False, eos=False)
    assert all(0 <= i < tokenizer.bos_id for i in ids)
    assert tokenizer.decode(ids) == text


def test_shipped_tokenizer_compresses_english(tokenizer):
    text = "Return the number of elements in the list, or raise an error if it is empty."
    assert len(tokenizer.encode(text, bos=False, eos=False)) < len(text) / 3


def test_bos_and_eos_frame_the_text(tokenizer):
    body = tokenizer.encode("some text", bos=False, eos=False)
    assert tokenizer.encode("some text", bos=True, eos=False) == [tokenizer.bos_id, *body]
    assert tokenizer.encode("some text", bos=False, eos=True) == [*body, tokenizer.eos_id]
    assert tokenizer.encode("", bos=True, eos=True) == [tokenizer.bos_id, tokenizer.eos_id]


def test_special_token_text_is_encoded_as_ordinary_text(tokenizer):
    ids = tokenizer.encode("<|end_of_text|><|begin_of_text|>", bos=False, eos=False)
    assert tokenizer.eos_id not in ids and tokenizer.bos_id not in ids
    assert tokenizer.decode(ids) == "<|end_of_text|><|begin_of_text|>"


def test_encode_batch_matches_encode(tokenizer):
    expected = [tokenizer.encode(t, bos=True, eos=True) for t in TEXTS]
    assert tokenizer.encode_batch(TEXTS, bos=True, eos=True) == expected


def test_special_tokens_follow_the_ranks(tmp_path):
    path = tmp_path / "tiny.model"
    save_ranks({**BYTE_RANKS, b"ab": 256, b"abc": 257}, path)
    tokenizer = load_tokenizer(path)
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.vocab_size) == (258, 259, 260)
    assert tokenizer.encode("abc", bos=True, eos=True) == [258, 257, 259]


def test_llama3_special_token_layout():
    names = llama3_special_tokens()
    assert len(names) == len(set(names)) == 256
    ids = {name: 128_000 + i for i, name in enumerate(names)}
    assert ids["<|begin_of_text|>"] == 128000
    assert ids["<|end_of_text|>"] == 128001
    assert ids["<|start_header_id|>"] == 128006
    assert ids["<|end_header_id|>"] == 128007
    assert ids["<|eot_id|>"] == 128009
    assert ids["<|reserved_special_token_250|>"] == 128255


def test_save_and_load_ranks_round_trip(tmp_path):
    ranks = {**BYTE_RANKS, b" the": 256, "é".encode(): 257}
    save_ranks(ranks, tmp_path / "t.model")
    assert load_ranks(tmp_path / "t.model") == ranks


def test_tokenizer_hash_tracks_file_content(tmp_path):
    path = tmp_path / "t.model"
    save_ranks(BYTE_RANKS, path)
    assert load_tokenizer(path).sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    before = load_tokenizer(path).sha256
    save_ranks({**BYTE_RANKS, b"ab": 256}, path)
    assert load_tokenizer(path).sha256 != before


@pytest.mark.parametrize(
    "content",
    [
        None,  # missing file
        b"",
        b"\n\n",
        b"not base64 at all\n",
        b"QQ== zero\n",
        b"\x0a\x8f\x01\xff\xfe binary\x00 protobuf\n",  # e.g. a SentencePiece model
        b"QQ== 0\nQg== 5\n",  # ranks not 0..N-1, and most bytes missing
    ],
    ids=["missing", "empty", "blank", "not-base64", "bad-rank", "binary", "gaps"],
)
def test_bad_tokenizer_file_names_the_path(tmp_path, content):
    path = tmp_path / "tokenizer.model"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(TorchpreError, match=re.escape(str(path))) as error:
        load_tokenizer(path)
    assert "model.tokenizer_path" in str(error.value)


def test_tokenizer_file_without_all_bytes_is_rejected(tmp_path):
    path = tmp_path / "tokenizer.model"
    save_ranks({bytes([b]): b for b in range(200)}, path)
    with pytest.raises(TorchpreError, match="lacks 56 single-byte tokens"):
        load_tokenizer(path)


# --- BPE training ---------------------------------------------------------------------------


def _merged_tokens(ranks: dict[bytes, int]) -> list[bytes]:
    return sorted((t for t in ranks if len(t) > 1), key=ranks.get)


def test_bpe_merges_most_frequent_pairs_with_fixed_tie_break():
    ranks = train_bpe(["hello hello hello world"], 256 + 5, LLAMA3_PAT_STR)
    # Pairs tie at count 3 inside "hello": the smallest (left id, right id) wins each time.
    assert _merged_tokens(ranks) == [b"el", b"hel", b"lo", b"hello", b" hello"]
    assert sorted(ranks.values()) == list(range(256 + 5))


def test_bpe_frequent_word_becomes_one_token(tmp_path):
    documents = ["the cat sat on the mat with the hat"] * 10
    save_ranks(train_bpe(documents, 256 + 20, LLAMA3_PAT_STR), tmp_path / "t.model")
    tokenizer = load_tokenizer(tmp_path / "t.model")
    assert len(tokenizer.encode(" the", bos=False, eos=False)) == 1


def _random_documents(seed: int) -> list[str]:
    """Words over a 2-letter alphabet: the same bytes can be merged along many different splits."""
    rng = random.Random(seed)
    words = ["".join(rng.choices("ab", k=rng.randint(1, 9))) for _ in range(200)]
    return [" ".join(rng.choices(words, k=50)) for _ in range(20)]


def test_bpe_merges_are_reproduced_by_tiktoken():
    """Reference: re-segment the corpus with tiktoken after every rank, as a naive trainer would.

    Each learned token must be the most frequent adjacent pair (same tie-break) of the tiktoken
    segmentation under the ranks before it, so tiktoken encodes text just as training did.
    """
    documents = _random_documents(seed=0)
    ranks = train_bpe(documents, 256 + 60, LLAMA3_PAT_STR)
    pieces = Counter(p for doc in documents for p in regex.findall(LLAMA3_PAT_STR, doc))
    learned = sorted(ranks, key=ranks.get)
    for rank in range(256, len(learned)):
        encoding = tiktoken.Encoding(
            "reference",
            pat_str=LLAMA3_PAT_STR,
            mergeable_ranks={token: r for r, token in enumerate(learned[:rank])},
            special_tokens={},
        )
        pairs = Counter()
        for piece, count in pieces.items():
            ids = encoding.encode_ordinary(piece)
            for pair in zip(ids, ids[1:]):
                pairs[pair] += count
        best = max(pairs, key=lambda pair: (pairs[pair], -pair[0], -pair[1]))
        assert learned[best[0]] + learned[best[1]] == learned[rank], f"rank {rank}"


def test_bpe_is_deterministic():
    documents = _random_documents(seed=1)
    first = train_bpe(documents, 256 + 50, LLAMA3_PAT_STR)
    again = train_bpe(iter(documents), 256 + 50, LLAMA3_PAT_STR)
    assert list(again.items()) == list(first.items())


def test_bpe_stops_when_no_pair_is_left():
    ranks = train_bpe(["ab"], 1000, LLAMA3_PAT_STR)
    assert _merged_tokens(ranks) == [b"ab"]


def test_bpe_rejects_vocab_smaller_than_bytes():
    with pytest.raises(ValueError, match="at least 256"):
        train_bpe(["text"], 100, LLAMA3_PAT_STR)
