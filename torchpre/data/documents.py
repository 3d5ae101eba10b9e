"""Where training text comes from: the built-in corpus or the user's local files."""

import json
from pathlib import Path

from torchpre.errors import TorchpreError

TEXT_SUFFIXES = (".txt", ".jsonl")


def load_documents(dataset: str, dataset_path: str, text_field: str = "text") -> list[str]:
    """Returns the documents of `training.dataset`, in a deterministic order.

    `stdlib` is the built-in corpus (docstrings and comments of Python's standard library);
    `text` reads `training.dataset_path`: a `.txt` file (one document), a `.jsonl` file (one
    document per line, in the `text_field` field) or a folder of such files, sorted by name.
    """
    if dataset == "stdlib":
        from torchpre.data.corpus import stdlib_documents

        documents = stdlib_documents()
    else:
        documents = [doc for path in _text_files(dataset_path) for doc in _read_file(path, text_field)]
    documents = [doc for doc in documents if doc.strip()]
    if not documents:
        source = dataset_path or dataset
        raise TorchpreError(
            f"The dataset '{source}' holds no text (training.dataset = '{dataset}'). "
            "Point training.dataset_path at non-empty .txt or .jsonl files."
        )
    return documents


def _text_files(dataset_path: str) -> list[Path]:
    path = Path(dataset_path)
    if not path.exists():
        raise TorchpreError(
            f"training.dataset_path '{dataset_path}' does not exist. "
            "Give a .txt or .jsonl file, or a folder holding such files."
        )
    if path.is_file():
        files = [path]
    else:
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
    unsupported = [p for p in files if p.suffix not in TEXT_SUFFIXES]
    if unsupported or not files:
        raise TorchpreError(
            f"training.dataset_path '{dataset_path}' has no readable text files "
            f"(supported: {', '.join(TEXT_SUFFIXES)}; found {unsupported[0].name if unsupported else 'none'})."
        )
    return files


def _read_file(path: Path, text_field: str) -> list[str]:
    if path.suffix == ".txt":
        return [path.read_text(encoding="utf-8", errors="replace")]
    documents = []
    lines = path.read_bytes().splitlines()
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)[text_field]  # json.loads takes UTF-8 bytes and rejects other encodings
            if not isinstance(text, str):
                raise TypeError(f"'{text_field}' is {type(text).__name__}, not a string")
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as error:
            raise TorchpreError(
                f"{path}:{line_number} is not a JSON object with a string '{text_field}' field "
                f"({error}). Each line of a .jsonl dataset must look like {{\"{text_field}\": \"...\"}}."
            ) from None
        documents.append(text)
    return documents
