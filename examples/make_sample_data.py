"""Writes a small sample corpus to try `torchpre.data.prepare` and shard mixtures on:

    python examples/make_sample_data.py web code

`web/part-0.jsonl` and `web/part-1.jsonl`: the standard library's docstrings and comments as
`{"text": ...}` lines (prose); `code/*.txt`: the source of a few standard-library modules (code).
"""

import argparse
import inspect
import json
from pathlib import Path

from torchpre.data.corpus import stdlib_documents

CODE_MODULES = ("argparse", "json.decoder", "json.encoder", "textwrap", "dataclasses", "pathlib")


def write_web(folder: Path, parts: int = 2) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    documents = stdlib_documents()
    for part in range(parts):
        with open(folder / f"part-{part}.jsonl", "w", encoding="utf-8") as file:
            for text in documents[part::parts]:
                file.write(json.dumps({"text": text}) + "\n")


def write_code(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in CODE_MODULES:
        module = __import__(name, fromlist=["_"])
        (folder / f"{name}.txt").write_text(inspect.getsource(module), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("web", type=Path, help="folder for the prose sample (.jsonl)")
    parser.add_argument("code", type=Path, help="folder for the code sample (.txt)")
    options = parser.parse_args()
    write_web(options.web)
    write_code(options.code)
    print(f"wrote {options.web}/part-*.jsonl and {options.code}/*.txt")


if __name__ == "__main__":
    main()
