"""A stand-in for a released model's Hugging Face tokenizer: tokenizer.json and tokenizer_config.json of one of the
three kinds released models ship, trained here with the `tokenizers` library's trainers on the standard library's
docstrings (`torchpre.data.corpus`) and a few lines of other scripts; nothing is downloaded.

    python scripts/tiny_tokenizer.py KIND OUT_DIR [--vocab-size N]

KIND is one of
- `byte_level`: byte-level BPE as Qwen ships it (NFC, Qwen's pre-split regex, `Qwen2Tokenizer`, no BOS, EOS
  `<|endoftext|>`);
- `byte_level_bos`: byte-level BPE as Llama 3 ships it (`PreTrainedTokenizerFast`, whose post-processor adds the BOS
  `<|begin_of_text|>`, EOS `<|end_of_text|>`);
- `byte_fallback`: BPE with byte fallback behind a Metaspace pre-tokenizer as Mistral and Llama 2 ship it
  (`LlamaTokenizer`, BOS `<s>` added, EOS `</s>`);
- `unigram`: a Unigram model behind NFKC and Metaspace (`PreTrainedTokenizerFast`, no BOS, EOS `</s>`).
Each writes the files transformers loads (`AutoTokenizer.from_pretrained(OUT_DIR)`) with the ids the
`tokenizers` library gives; OUT_DIR may already hold a model (scripts/tiny_release.py).
"""

import argparse
import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from torchpre.data.corpus import stdlib_documents

KINDS = ("byte_level", "byte_level_bos", "byte_fallback", "unigram")
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
OTHER_SCRIPTS = [
    "中文文本的例子，日本語のテキスト、한국어 텍스트입니다.",
    "Ελληνικά, русский текст, עברית, العربية, हिन्दी",
    "emoji 😀🎉👍🏽 and café, naïve, façade, coöperate",
]
DEFAULT_VOCAB = {"byte_level": 1000, "byte_level_bos": 900, "byte_fallback": 800, "unigram": 600}
_CORPUS_CHARS = 150_000  # enough for a few hundred tokens; the trainers take at most a second or two on it


def corpus() -> list[str]:
    """The first documents of the built-in corpus up to _CORPUS_CHARS characters, and the lines of other scripts."""
    documents, size = [], 0
    for document in stdlib_documents():
        if size >= _CORPUS_CHARS:
            break
        documents.append(document)
        size += len(document)
    return documents + OTHER_SCRIPTS * 10


def byte_level(vocab_size: int) -> tuple[Tokenizer, dict[str, Any]]:
    """Qwen's pipeline: NFC, its pre-split regex, bytes mapped to characters, BPE; no BOS, no post-processing."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tokenizer.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )  # fmt: skip
    tokenizer.train_from_iterator(corpus(), trainer)
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    config = {
        "tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>", "unk_token": None, "add_prefix_space": False, "model_max_length": 32768,
    }  # fmt: skip
    return tokenizer, config


def byte_level_bos(vocab_size: int) -> tuple[Tokenizer, dict[str, Any]]:
    """Llama 3's way of shipping byte-level BPE: the pipeline as Qwen's, its special tokens added after the ranks, a
    post-processor that adds BOS before every text, read by transformers as the file says
    (`PreTrainedTokenizerFast`)."""
    tokenizer, _ = byte_level(vocab_size - 3)
    special = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in special])
    bos = ("<|begin_of_text|>", tokenizer.token_to_id("<|begin_of_text|>"))
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]} $B:1", special_tokens=[bos]),
    ])  # fmt: skip
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos[0], "eos_token": "<|end_of_text|>",
        "model_max_length": 131072,
    }  # fmt: skip
    return tokenizer, config


def byte_fallback(vocab_size: int) -> tuple[Tokenizer, dict[str, Any]]:
    """Mistral's and Llama 2's pipeline: Metaspace (a `▁` before the first word), BPE whose unknown characters fall
    back to the 256 byte tokens `<0x00>`..`<0xFF>` (ids 3 to 258, after `<unk>`, `<s>`, `</s>`), BOS added."""
    special = ["<unk>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 256, special_tokens=special, show_progress=False)
    learner = Tokenizer(models.BPE(unk_token="<unk>"))
    # Trained word by word (split), as SentencePiece trains; encoded unsplit, as transformers' LlamaTokenizer does.
    learner.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    learner.train_from_iterator(corpus(), trainer)
    learned = json.loads(learner.to_str())["model"]
    pieces = [token for token, _ in sorted(learned["vocab"].items(), key=lambda item: item[1]) if token not in special]
    vocab = {token: i for i, token in enumerate([*special, *(f"<0x{b:02X}>" for b in range(256)), *pieces])}
    merges = [tuple(merge) if isinstance(merge, list) else tuple(merge.split(" ")) for merge in learned["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in special])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    config = {
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False, "legacy": False, "model_max_length": 32768,
    }  # fmt: skip
    return tokenizer, config


def unigram(vocab_size: int) -> tuple[Tokenizer, dict[str, Any]]:
    """A Unigram model behind NFKC and Metaspace (a `▁` before every word), without BOS or post-processing."""
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    special = ["<pad>", "</s>", "<unk>"]
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size, special_tokens=special, unk_token="<unk>", show_progress=False
    )
    tokenizer.train_from_iterator(corpus(), trainer)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "pad_token": "<pad>",
        "unk_token": "<unk>", "model_max_length": 32768,
    }  # fmt: skip
    return tokenizer, config


BUILDERS = {
    "byte_level": byte_level, "byte_level_bos": byte_level_bos, "byte_fallback": byte_fallback, "unigram": unigram
}


def write(kind: str, folder: Path, vocab_size: int | None = None) -> Path:
    """Trains a tokenizer of `kind` and writes its tokenizer.json and tokenizer_config.json into `folder`."""
    tokenizer, config = BUILDERS[kind](vocab_size or DEFAULT_VOCAB[kind])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--vocab-size", type=int, default=None, help="ids of the tokenizer (default: by kind)")
    options = parser.parse_args()
    folder = write(options.kind, options.out_dir, options.vocab_size)
    size = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size()
    print(f"{folder}: a {options.kind} tokenizer of {size:,} ids")


if __name__ == "__main__":
    main()
