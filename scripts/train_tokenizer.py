"""Train the small byte-level BPE tokenizer shipped in assets/tokenizer/.

It is trained on the stdlib corpus (`torchpre.data.corpus`) with Llama 3's pre-split regex and
written in tiktoken's format, so `torchpre.data.tiktoken_bpe.TiktokenTokenizer` loads it like Llama 3's own.
"""

import argparse
import time
from pathlib import Path

from torchpre.data.bpe import train_bpe
from torchpre.data.corpus import stdlib_documents
from torchpre.data.tiktoken_bpe import DEFAULT_TOKENIZER_PATH, LLAMA3_PAT_STR, TiktokenTokenizer, save_ranks


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=2046,
        help="number of mergeable ranks (256 bytes + merges); BOS and EOS come on top",
    )
    parser.add_argument("--output", type=Path, default=DEFAULT_TOKENIZER_PATH)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    documents = stdlib_documents()
    start = time.perf_counter()
    ranks = train_bpe(documents, args.vocab_size, LLAMA3_PAT_STR, progress=True)
    seconds = time.perf_counter() - start
    args.output.parent.mkdir(parents=True, exist_ok=True)
    save_ranks(ranks, args.output)

    tokenizer = TiktokenTokenizer(args.output)
    num_tokens = sum(map(len, tokenizer.encode_batch(documents, bos=False, eos=False)))
    num_chars = sum(map(len, documents))
    print(
        f"Wrote {args.output}: {len(ranks)} ranks, vocab_size {tokenizer.vocab_size}, "
        f"trained in {seconds:.1f}s, {num_tokens / num_chars:.3f} tokens/char "
        f"on {len(documents)} documents ({num_chars / 1e6:.2f}M chars)"
    )


if __name__ == "__main__":
    main()
