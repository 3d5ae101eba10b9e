"""Hugging Face tokenizers (`tokenizer.json`): the same ids as `transformers.AutoTokenizer.from_pretrained(folder)`
for each kind released models ship, framing as the family frames a document, and the files read as data from
others. The tokenizers are trained here (scripts/tiny_tokenizer.py); nothing is downloaded."""

import json
import pickle
import shutil
from pathlib import Path

import pytest

from scripts.tiny_tokenizer import KINDS, write
from tests.tokenizer_texts import MIXED
from torchpre.data.hf_tokenizer import HFTokenizer
from torchpre.data.tokenizer import load_tokenizer
from torchpre.errors import TorchpreError, UntrustedInput

transformers = pytest.importorskip("transformers")



@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """One tokenizer folder of each kind, trained once."""
    root = tmp_path_factory.mktemp("tokenizers")
    return {kind: write(kind, root / kind) for kind in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_ids_equal_transformers_on_a_mixed_corpus(folders, kind):
    """Every text of the mixed corpus gives transformers' ids, framed (`tokenizer(text)`) and bare
    (`add_special_tokens=False`), one by one and in a batch, and decodes as transformers decodes."""
    reference = transformers.AutoTokenizer.from_pretrained(folders[kind])
    ours = load_tokenizer(folders[kind])
    assert isinstance(ours, HFTokenizer)
    for text in MIXED:
        expected = reference(text)["input_ids"]
        assert ours.encode(text, bos=True, eos=False) == expected, repr(text[:40])
        bare = ours.encode(text, bos=False, eos=False)
        assert bare == reference(text, add_special_tokens=False)["input_ids"], repr(text[:40])
        assert ours.decode(expected) == reference.decode(expected), repr(text[:40])
    assert ours.encode_batch(MIXED, bos=True, eos=True) == [ours.encode(t, bos=True, eos=True) for t in MIXED]
    assert ours.vocab_size == len(reference)


@pytest.mark.parametrize(
    "kind, bos, eos",
    [("byte_level", None, "<|endoftext|>"), ("byte_level_bos", "<|begin_of_text|>", "<|end_of_text|>"),
     ("byte_fallback", "<s>", "</s>"), ("unigram", None, "</s>")],
)  # fmt: skip
def test_a_document_is_framed_as_the_family_frames_one(folders, kind, bos, eos):
    """BOS where the family adds one (none for Qwen's), EOS after every document."""
    reference = transformers.AutoTokenizer.from_pretrained(folders[kind])
    ours = load_tokenizer(folders[kind])
    assert ours.bos_id == (None if bos is None else reference.convert_tokens_to_ids(bos))
    assert ours.eos_id == reference.convert_tokens_to_ids(eos)
    body = ours.encode("some text", bos=False, eos=False)
    start = [] if bos is None else [ours.bos_id]
    assert ours.encode("some text", bos=True, eos=True) == [*start, *body, ours.eos_id]


@pytest.mark.parametrize("kind", ["byte_level", "byte_fallback"])
def test_special_token_text_in_a_document_is_ordinary_text(folders, kind):
    """A document holding "<|endoftext|>" or "</s>" as text does not end there: its ids are transformers' with
    split_special_tokens."""
    reference = transformers.AutoTokenizer.from_pretrained(folders[kind], split_special_tokens=True)
    ours = load_tokenizer(folders[kind])
    text = "one <|endoftext|> two </s> three <s>"
    ids = ours.encode(text, bos=False, eos=False)
    assert ids == reference(text, add_special_tokens=False)["input_ids"]
    assert ours.eos_id not in ids


def test_a_pickled_tokenizer_is_rebuilt_from_the_bytes_read_not_the_path(folders, tmp_path):
    """prepare's workers get the parent's tokenizer: the files it read, whatever the path holds since."""
    folder = shutil.copytree(folders["byte_fallback"], tmp_path / "copy")
    ours = load_tokenizer(folder)
    (folder / "tokenizer.json").write_text("{}")
    again = pickle.loads(pickle.dumps(ours))
    assert again.encode("a sentence", bos=True, eos=True) == ours.encode("a sentence", bos=True, eos=True)
    assert again.sha256 == ours.sha256


def test_the_hash_covers_both_files(folders, tmp_path):
    """Shards are tied to tokenizer.json and tokenizer_config.json: another BOS or EOS is another tokenizer."""
    folder = shutil.copytree(folders["unigram"], tmp_path / "copy")
    before = load_tokenizer(folder).sha256
    assert load_tokenizer(folder / "tokenizer.json").sha256 == before  # the same files, named by the json
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"eos_token": "<pad>"}))
    assert load_tokenizer(folder).sha256 != before


def test_without_a_config_the_post_processor_says_bos_and_eos_must_be_named(folders, tmp_path):
    """A lone tokenizer.json: its post-processor's BOS is used; the EOS it cannot say is refused by name."""
    folder = shutil.copytree(folders["byte_level_bos"], tmp_path / "copy")
    (folder / "tokenizer_config.json").unlink()
    with pytest.raises(UntrustedInput, match="no tokenizer_config.json, and its post_processor adds none") as error:
        load_tokenizer(folder / "tokenizer.json")
    assert str(folder / "tokenizer.json") in str(error.value)


def test_a_config_that_disagrees_with_the_post_processor_is_refused_naming_both(folders, tmp_path):
    """add_bos_token false beside a post-processor that adds BOS: transformers 4 and 5 would give other ids."""
    folder = shutil.copytree(folders["byte_fallback"], tmp_path / "copy")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"add_bos_token": False}))
    with pytest.raises(UntrustedInput, match="add_bos_token = false, but the post_processor") as error:
        load_tokenizer(folder)
    assert str(folder / "tokenizer_config.json") in str(error.value)
    assert str(folder / "tokenizer.json") in str(error.value)


@pytest.mark.parametrize(
    "edit, fragment",
    [
        (lambda spec: spec["model"].update(type="SentencePiece"), "'model.type' is 'SentencePiece', not one of"),
        (lambda spec: spec["model"].update(dropout=0.1), "'model.dropout' is 0.1"),
        (lambda spec: spec["model"]["vocab"].update({"x": -1}), "'model.vocab.x' is -1, not a token id"),
        (lambda spec: spec["added_tokens"][0].update(id="3"), "'added_tokens[0].id' is \"3\", not an integer"),
        (lambda spec: spec.update(pre_tokenizer={"type": "NoSuchThing"}), "the tokenizers library cannot read it"),
    ],
    ids=["unknown-model-type", "dropout", "negative-id", "added-id-a-string", "unknown-pre-tokenizer"],
)
def test_a_malformed_tokenizer_json_is_refused_naming_the_file_and_field(folders, tmp_path, edit, fragment):
    folder = shutil.copytree(folders["byte_fallback"], tmp_path / "copy")
    spec = json.loads((folder / "tokenizer.json").read_text())
    edit(spec)
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(TorchpreError, match=fragment.replace("(", r"\(").replace("[", r"\[")) as error:
        load_tokenizer(folder)
    assert str(folder / "tokenizer.json") in str(error.value)


def test_a_lone_surrogate_in_a_text_is_encoded_as_the_replacement_character(folders):
    """JSON text may hold "\\ud800", which no UTF-8 can: it becomes U+FFFD, as the tiktoken tokenizer makes it."""
    ours = load_tokenizer(folders["byte_level"])
    assert ours.encode("a\ud800b", bos=True, eos=True) == ours.encode("a\ufffdb", bos=True, eos=True)
    replaced = ours.encode("a\ufffdb", bos=False, eos=False)
    assert ours.encode_batch(["ok", "a\udfffb"], bos=False, eos=False)[1] == replaced


def test_a_special_token_named_by_a_lone_surrogate_is_no_token(folders, tmp_path):
    folder = shutil.copytree(folders["byte_fallback"], tmp_path / "copy")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"bos_token": "\ud800"}))
    with pytest.raises(UntrustedInput, match=r"bos_token = '\\ud800' is not a token of"):
        load_tokenizer(folder)


def test_truncation_and_padding_in_tokenizer_json_leave_a_document_whole(folders, tmp_path):
    """A released tokenizer.json may carry the truncation and padding of its fine-tuning: a document is tokenized
    whole all the same, as transformers' `tokenizer(text)` does without truncation=True."""
    folder = shutil.copytree(folders["byte_level"], tmp_path / "copy")
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
    spec["padding"] = {"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0,
                       "pad_type_id": 0, "pad_token": "<|endoftext|>"}  # fmt: skip
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    whole = load_tokenizer(folders["byte_level"]).encode(MIXED[1], bos=True, eos=True)
    assert len(whole) > 16
    assert load_tokenizer(folder).encode(MIXED[1], bos=True, eos=True) == whole
