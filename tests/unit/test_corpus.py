"""The stdlib corpus: real prose, deterministic, extracted once and then read from the cache."""

import string

import pytest

from torchpre.data import corpus


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A private cache dir for this module; the first test to use it pays for the extraction."""
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("torchpre-cache")
        mp.setenv("TORCHPRE_CACHE", str(path))
        yield path


@pytest.fixture(scope="module")
def documents(cache):
    return corpus.stdlib_documents()


def test_corpus_is_a_few_megabytes_of_modules(documents):
    assert len(documents) > 200
    assert sum(map(len, documents)) > 1_000_000
    assert all(doc.strip() for doc in documents)


def test_corpus_is_mostly_prose(documents):
    words = [w.strip(string.punctuation) for doc in documents for w in doc.split()]
    assert sum(w.isalpha() for w in words) / len(words) > 0.8


def test_corpus_has_no_shebangs_or_pragmas(documents):
    lines = {line.strip() for doc in documents for line in doc.splitlines()}
    assert not any(line.startswith(("!/", "-*-", "noqa", "type: ignore")) for line in lines)


def test_cache_is_written_once_then_read(cache, documents, monkeypatch, capsys):
    assert [p.suffix for p in cache.iterdir()] == [".jsonl"]  # no temp file left behind

    def fail():
        raise AssertionError("the corpus was extracted again instead of read from the cache")

    monkeypatch.setattr(corpus, "_extract_stdlib_documents", fail)
    assert corpus.stdlib_documents() == documents
    assert capsys.readouterr() == ("", "")


def test_extraction_is_deterministic(documents):
    assert corpus._extract_stdlib_documents() == documents


def test_cache_dir_defaults_to_home(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCHPRE_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert corpus.cache_dir() == tmp_path / ".cache" / "torchpre"


@pytest.mark.parametrize(
    ("comment", "is_prose"),
    [
        ("Return the number of bytes written so far.", True),
        ("!/usr/bin/env python3", False),
        ("-*- coding: utf-8 -*-", False),
        ("noqa: F401 unused import here", False),
        ("x = compute(a, b)", False),
        ("return self._cache[key]", False),
        ("-----------------------------", False),
        ("XXX", False),
    ],
)
def test_is_prose(comment, is_prose):
    assert corpus._is_prose(comment) is is_prose
