"""The default training corpus: the prose of the Python standard library.

Every machine that runs torchpre has a Python interpreter, and its standard library holds a few
megabytes of English written by people: module, class and function docstrings and explanatory
comments. That makes a real natural-language corpus available offline, with no download, which
is what the quick start, the tests and the shipped tokenizer are built on.

Extraction parses a few hundred files, so its result is cached as JSONL, one document per line,
keyed by the interpreter version and `_EXTRACTION_VERSION`.
"""

import ast
import io
import json
import os
import re
import sys
import sysconfig
import tempfile
import tokenize
from pathlib import Path

# Bump whenever the extraction below changes what it produces, so stale caches are ignored.
_EXTRACTION_VERSION = 1

# Directories holding third-party code, tests, tools or generated tables (the codecs in
# `encodings` comment every byte with its Unicode name) rather than documented library code.
_SKIP_DIRS = frozenset(
    {
        "__pycache__",
        "encodings",
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idle_test",
        "idlelib",
        "lib2to3",
        "turtledemo",
    }
)

# Comments that are tool directives, not prose.
_PRAGMA = re.compile(
    r"^(!|-\*-|noqa|type:|pragma|pylint|fmt:|flake8|mypy|isort|XXX$|TODO$)", re.IGNORECASE
)
# Comment lines that start like a statement are usually commented-out code.
_CODE_START = re.compile(
    r"^(def|class|import|from|return|if|elif|else|for|while|try|except|with|raise|assert|print)\b"
    r"|^\w+(\.\w+)*\s*(=|\()"
)
_MIN_COMMENT_WORDS = 3
_MIN_PROSE_RATIO = 0.8  # share of letters and spaces in a comment line


def cache_dir() -> Path:
    """Where torchpre caches derived files: `$TORCHPRE_CACHE`, else `~/.cache/torchpre`."""
    return Path(os.environ.get("TORCHPRE_CACHE") or Path.home() / ".cache" / "torchpre")


def stdlib_documents() -> list[str]:
    """One document per standard-library module (its docstrings and comments), in path order.

    The first call extracts and caches the corpus; later calls, in any process, read the cache.
    """
    path = _cache_path()
    if not path.is_file():
        print(f"torchpre: extracting the stdlib text corpus into {path} (once)", file=sys.stderr)
        _write_jsonl_atomically(_extract_stdlib_documents(), path)
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _cache_path() -> Path:
    version = "".join(map(str, sys.version_info[:3]))
    name = f"stdlib-docs-{sys.implementation.name}{version}-v{_EXTRACTION_VERSION}.jsonl"
    return cache_dir() / name


def _write_jsonl_atomically(documents: list[str], path: Path) -> None:
    """Write via a temporary file and `os.replace`, so concurrent ranks never see a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(
        "w", encoding="utf-8", dir=path.parent, prefix=path.name, suffix=".tmp", delete=False
    ) as f:
        f.writelines(json.dumps(doc, ensure_ascii=False) + "\n" for doc in documents)
    os.replace(f.name, path)


def _extract_stdlib_documents() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    documents = (_module_text(path) for path in _stdlib_sources(root))
    return [doc for doc in documents if doc]


def _stdlib_sources(root: Path) -> list[Path]:
    """The stdlib's `.py` files, sorted by path relative to `root` so the order is reproducible."""
    sources = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        sources += [Path(dirpath, name) for name in filenames if name.endswith(".py")]
    return sorted(sources, key=lambda p: p.relative_to(root).as_posix())


def _module_text(path: Path) -> str:
    """A module's docstrings and prose comments in source order; empty if it does not parse."""
    try:
        source = path.read_bytes()
        tree = ast.parse(source)
        pieces = _docstrings(tree) + _comments(source)
    except (SyntaxError, ValueError, UnicodeDecodeError, tokenize.TokenError):
        return ""
    return "\n".join(text for _, text in sorted(pieces, key=lambda piece: piece[0]))


def _docstrings(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, docstring) pairs; `ast.get_docstring` dedents them with `inspect.cleandoc`."""
    documented = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    pieces = []
    for node in ast.walk(tree):
        if isinstance(node, documented) and (doc := ast.get_docstring(node, clean=True)):
            pieces.append((node.body[0].lineno, doc))
    return pieces


def _comments(source: bytes) -> list[tuple[int, str]]:
    """(line, text) pairs for the comments that read as prose."""
    tokens = tokenize.tokenize(io.BytesIO(source).readline)
    comments = (
        (tok.start[0], tok.string.lstrip("#").strip())
        for tok in tokens
        if tok.type == tokenize.COMMENT
    )
    return [(line, text) for line, text in comments if _is_prose(text)]


def _is_prose(comment: str) -> bool:
    """Keep sentences; drop pragmas, shebangs, separators, short notes and commented-out code."""
    if len(comment.split()) < _MIN_COMMENT_WORDS:
        return False
    if _PRAGMA.match(comment) or _CODE_START.match(comment):
        return False
    letters = sum(c.isalpha() or c.isspace() for c in comment)
    return letters / len(comment) >= _MIN_PROSE_RATIO
