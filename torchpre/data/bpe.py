"""Byte-level BPE training that produces tiktoken mergeable ranks.

The result is meant for `tiktoken.Encoding`, which encodes a pre-split piece by repeatedly merging
the adjacent pair whose concatenation has the lowest rank. The trainer keeps every distinct
pre-split word segmented exactly as tiktoken would segment it with the ranks learned so far, so
the shipped file reproduces the training merges and never holds two ranks for the same bytes.

Training is the standard efficient algorithm: count distinct words once, keep a count per adjacent
token pair and an index from pair to words, and after each merge re-count only the words it
touched. The next merge is the most frequent pair; ties go to the smallest (left id, right id).
"""

import heapq
from collections import Counter, defaultdict
from collections.abc import Iterable

import regex
from tqdm import tqdm

Pair = tuple[int, int]


def train_bpe(
    documents: Iterable[str], vocab_size: int, pat_str: str, *, progress: bool = False
) -> dict[bytes, int]:
    """Learn `vocab_size` mergeable ranks (256 single bytes, then one rank per merge).

    Stops early, with fewer ranks, if the documents run out of pairs to merge.
    """
    if vocab_size < 256:
        raise ValueError(f"vocab_size must be at least 256 (one rank per byte), got {vocab_size}")
    word_counts = _count_words(documents, pat_str, progress)
    trainer = _Trainer(list(word_counts), list(word_counts.values()))
    for _ in tqdm(range(vocab_size - 256), desc="merges", disable=not progress):
        if not trainer.merge_most_frequent_pair():
            break
    return {token: rank for rank, token in enumerate(trainer.tokens)}


def _count_words(documents: Iterable[str], pat_str: str, progress: bool) -> Counter[bytes]:
    """Pre-split with the tokenizer's regex, as tiktoken does before merging."""
    pattern = regex.compile(pat_str)
    counts: Counter[bytes] = Counter()
    for doc in tqdm(documents, desc="pre-splitting", unit="doc", disable=not progress):
        counts.update(word.encode("utf-8") for word in pattern.findall(doc))
    return counts


class _Trainer:
    """Distinct words as token-id lists, with pair counts kept in sync after each merge."""

    def __init__(self, words: list[bytes], counts: list[int]) -> None:
        self.tokens: list[bytes] = [bytes([b]) for b in range(256)]
        self.ranks: dict[bytes, int] = {token: rank for rank, token in enumerate(self.tokens)}
        self.words: list[list[int]] = [list(word) for word in words]
        self.counts = counts
        self.pair_counts: Counter[Pair] = Counter()
        self.words_with_pair: defaultdict[Pair, set[int]] = defaultdict(set)
        for index, word in enumerate(self.words):
            self._add_pairs(index, word, +1)
        # Max-heap with lazy deletion: an entry is stale when its count differs from pair_counts.
        self.heap = [(-n, *pair) for pair, n in self.pair_counts.items()]
        heapq.heapify(self.heap)

    def merge_most_frequent_pair(self) -> bool:
        """Add the most frequent pair as the next token; False when no pair is left."""
        while self.heap:
            neg_count, left, right = heapq.heappop(self.heap)
            if self.pair_counts[left, right] == -neg_count > 0:
                self._add_token(self.tokens[left] + self.tokens[right])
                return True
        return False

    def _add_token(self, token: bytes) -> None:
        self.ranks[token] = len(self.tokens)
        self.tokens.append(token)
        changed: set[Pair] = set()
        for index in self._words_containing(token):
            old = self.words[index]
            new = self._tiktoken_merge(old)
            if new != old:
                changed |= self._add_pairs(index, old, -1) | self._add_pairs(index, new, +1)
                self.words[index] = new
        for pair in changed:
            if self.pair_counts[pair] > 0:
                heapq.heappush(self.heap, (-self.pair_counts[pair], *pair))

    def _words_containing(self, token: bytes) -> set[int]:
        """Words holding an adjacent pair whose bytes concatenate to `token`, whatever the split."""
        found: set[int] = set()
        for cut in range(1, len(token)):
            left, right = self.ranks.get(token[:cut]), self.ranks.get(token[cut:])
            if left is not None and right is not None:
                found |= self.words_with_pair.pop((left, right), set())
        return found

    def _tiktoken_merge(self, word: list[int]) -> list[int]:
        """Continue tiktoken's merging: join the lowest-ranked mergeable pair, leftmost first."""
        word = list(word)
        while len(word) > 1:
            joined = (self.tokens[a] + self.tokens[b] for a, b in zip(word, word[1:]))
            candidates = [(self.ranks[t], i) for i, t in enumerate(joined) if t in self.ranks]
            if not candidates:
                break
            rank, i = min(candidates)
            word[i : i + 2] = [rank]
        return word

    def _add_pairs(self, index: int, word: list[int], sign: int) -> set[Pair]:
        """Add (sign=+1) or remove (sign=-1) the word's pairs; returns the pairs touched.

        Removal leaves the word in `words_with_pair`: a stale entry only costs a re-check.
        """
        pairs = Counter(zip(word, word[1:]))
        for pair, n in pairs.items():
            self.pair_counts[pair] += sign * n * self.counts[index]
            if sign > 0:
                self.words_with_pair[pair].add(index)
        return set(pairs)
