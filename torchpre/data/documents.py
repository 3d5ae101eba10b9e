"""Where training text comes from: the built-in corpus or the user's local files."""

from pathlib import Path

from torchpre.confined import file_kind, open_file, open_named
from torchpre.errors import TorchpreError, UntrustedInput
from torchpre.json_input import JsonValue, json_lines

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
        documents = [doc for folder, name in _text_files(dataset_path) for doc in _read_file(folder, name, text_field)]
    documents = [doc for doc in documents if doc.strip()]
    if not documents:
        source = dataset_path or dataset
        raise TorchpreError(
            f"The dataset '{source}' holds no text (training.dataset = '{dataset}'). "
            "Point training.dataset_path at non-empty .txt or .jsonl files."
        )
    return documents


def _text_files(dataset_path: str) -> list[tuple[Path, str]]:
    """(folder, name) of the file `dataset_path` names, or of each text file of the folder it names, sorted. Data
    may come from others: a symbolic link in place of a file, or in the folder, which could lead anywhere on the
    machine, is refused by name instead of read into training (the named folder, or the file's, is followed)."""
    path = Path(dataset_path)
    if not path.exists():
        raise TorchpreError(
            f"training.dataset_path '{dataset_path}' does not exist. "
            "Give a .txt or .jsonl file, or a folder holding such files."
        )
    if path.is_file():
        files = [(path, "")]  # the file the key names: a link to it is the user's choice
    else:
        names = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES)
        files = [(path, name) for name in names if _kind_within(path, name) == "file"]
    unsupported = [name or folder.name for folder, name in files if Path(name or folder).suffix not in TEXT_SUFFIXES]
    if unsupported or not files:
        raise TorchpreError(
            f"training.dataset_path '{dataset_path}' has no readable text files "
            f"(supported: {', '.join(TEXT_SUFFIXES)}; found {Path(unsupported[0]).name if unsupported else 'none'})."
        )
    return files


def _kind_within(folder: Path, name: str) -> str:
    """What `folder/name` is (`confined.file_kind`); an UntrustedInput error if it is, or leads through, a link."""
    kind = file_kind(folder, name)
    if kind == "link":
        raise UntrustedInput(
            f"training.dataset_path '{folder}': {folder / name} is, or leads through, a symbolic link, which could "
            "lead out of the folder. Copy the real file in its place."
        )
    return kind


def _read_file(folder: Path, name: str, text_field: str) -> list[str]:
    """A .txt file's text (one document), or the `text_field` of each line of a .jsonl file, each line bounded
    (`json_input.json_lines`): `folder/name` opened by `confined.open_file`, so the file read is the one checked, or
    with no `name` the file `folder` the key names (`confined.open_named`)."""
    path = folder / name if name else folder
    with open_file(folder, name) if name else open_named(folder) as file:
        if path.suffix == ".txt":
            return [file.read().decode("utf-8", errors="replace")]
        return [_text(record, text_field, f"{path}:{number}") for number, record in json_lines(file, path)]


def _text(record: JsonValue, text_field: str, where: str) -> str:
    text = record.get(text_field) if isinstance(record, dict) else None
    if isinstance(text, str):
        return text
    if not isinstance(record, dict):
        found = "not an object"
    else:
        found = f"'{text_field}' is {type(text).__name__}" if text_field in record else f"no '{text_field}' field"
    raise TorchpreError(
        f"{where} is not a JSON object with a string '{text_field}' field ({found}). "
        f"Each line of a .jsonl dataset must look like {{\"{text_field}\": \"...\"}}."
    )
