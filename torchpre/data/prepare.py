"""Tokenize text into pre-tokenized shards for training with `training.dataset = "shards"`.

  python -m torchpre.data.prepare INPUT... --output DIR [--tokenizer PATH] [--text-field text]
      [--workers N] [--shard-tokens N] [--hf-split train] [--num-tasks N --task-index I]
  python -m torchpre.data.prepare --merge --num-tasks N --output DIR [--tokenizer PATH]

An INPUT is a `.txt` file (one document), a `.jsonl` file (one document per line, in the
`--text-field` field), a `.parquet` file (its `--text-field` column), a folder of such files (read
recursively, sorted by path), a folder written by `datasets`' `save_to_disk`, or a Hugging Face Hub
dataset name (needs `pip install torchpre[hf]`, and the Hub or its local cache). Blank documents
are skipped.

Each document is framed as the tokenizer's family frames one (BOS ... EOS; ... EOS for a family without a BOS,
such as Qwen's) and written, in input order, to shards of at most `--shard-tokens` tokens (a longer document gets
a shard of its own), cut only between documents;
see torchpre/data/shards.py for the format. The output does not depend on `--workers`.

The manifest records what the shards were made from (a SHA-256 of every input, the options, the tokenizer); it is
written at the start and the end, and each shard in between is appended to its journal (`manifest.journal`, see
torchpre/data/shards.py), so the work per shard does not grow with their number. Re-running the same command after an
interruption skips the documents of the shards already listed and writes the rest; a run with other inputs, options or
tokenizer into the same folder is refused.

Across machines: `--num-tasks N --task-index I` (one command per task, e.g. a Slurm array with I =
$SLURM_ARRAY_TASK_ID) tokenizes the I-th of N contiguous runs of the input files, of about equal bytes (a file is
never split: give at least as many files as tasks), into the shard folder `DIR.task-I-of-N` (I and N as 5 digits),
resumable as any prepare. Then `--merge --num-tasks N --output DIR` cuts the parts' documents, in task order, into
DIR's shards by the same rule, without tokenizing again: DIR is byte for byte the folder one task would have written.
The parts may be deleted afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import itertools
import multiprocessing
import os
import re
import signal
import socket
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, BinaryIO

import numpy as np
from tqdm import tqdm

from torchpre.confined import file_kind, open_for_append, open_named
from torchpre.data.shards import (
    JOURNAL,
    MANIFEST,
    DamagedShard,
    Manifest,
    journal_line,
    open_offsets,
    open_tokens,
    read_array,
    shard_file_problem,
    token_dtype,
    write_shard,
)
from torchpre.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer, load_tokenizer
from torchpre.errors import TorchpreError, UntrustedInput
from torchpre.json_input import JsonValue, json_lines

if TYPE_CHECKING:
    from datasets import Dataset

PROG = "python -m torchpre.data.prepare"
SUFFIXES = (".txt", ".jsonl", ".parquet")
# Bump when the framing or the shard cutting changes, so an old folder is not resumed with new rules.
PREPARE_VERSION = 1
DEFAULT_SHARD_TOKENS = 100_000_000  # 200 MB per shard at uint16: little work lost to an interruption
_BATCH_BYTES = 1 << 20  # text per task sent to a worker: large enough to amortise the pickling
_IN_FLIGHT_PER_WORKER = 4  # batches queued per worker: keeps workers busy while bounding memory
_HUB_PROBE_TIMEOUT_S = 3.0
_OFFSETS = np.dtype("<i8")  # a shard's .idx
_INPUT_HINT = (
    "Give .txt, .jsonl or .parquet files, folders of them, a folder saved with datasets' save_to_disk, "
    "or a Hugging Face Hub dataset name."
)


@dataclasses.dataclass(frozen=True)
class InputSource:
    """One input, read as records in a fixed order: a text, or None/blank for an empty record."""

    name: str
    files: tuple[Path, ...]  # what its fingerprint hashes
    records: int
    texts: Callable[[], Iterator[str | None]]


@dataclasses.dataclass(frozen=True)
class Batch:
    """Documents sent to a worker together, with what the progress bar and summary count."""

    texts: list[str]
    records: int
    text_bytes: int


Encoded = tuple[Batch, np.ndarray, np.ndarray]  # a batch, its documents' ids back to back, their lengths


@dataclasses.dataclass
class Stats:
    """This run's work, for the summary."""

    documents: int = 0
    tokens: int = 0
    text_bytes: int = 0
    shards: int = 0


def main(argv: list[str]) -> None:
    args = _parse_args(argv)
    started = time.perf_counter()
    tokenizer = load_tokenizer(args.tokenizer)
    if args.merge:
        merge(Path(args.output), args.num_tasks, tokenizer)
        return
    options = {"text_field": args.text_field, "shard_tokens": args.shard_tokens, "hf_split": args.hf_split}
    folder, task = Path(args.output), None
    if args.task_index is not None:
        folder, task = task_folder(folder, args.task_index, args.num_tasks), (args.task_index, args.num_tasks)
        options |= {"num_tasks": args.num_tasks, "task_index": args.task_index}
    sources = resolve_inputs(args.inputs, args.text_field, args.hf_split, task)
    record = {"prepare_version": PREPARE_VERSION, "options": options, "inputs": [_fingerprint(s) for s in sources]}
    manifest = open_output(folder, tokenizer, record)
    if manifest.complete:
        print(f"{folder} already holds all {len(manifest.shards)} shards of these inputs: nothing to do.")
        return
    resumed_shards = len(manifest.shards)
    try:
        stats = write_shards(sources, manifest, folder, tokenizer, args.workers, args.shard_tokens, task is not None)
    except KeyboardInterrupt:
        raise TorchpreError(
            f"Interrupted with {len(manifest.shards)} shards written to {folder}. Re-run the same command to resume."
        ) from None
    print(_summary(manifest, folder, stats, resumed_shards, time.perf_counter() - started, args.workers))


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, usage=argparse.SUPPRESS
    )
    parser.add_argument("inputs", nargs="*", metavar="INPUT", help="files, folders or a Hugging Face dataset")
    parser.add_argument("--output", required=True, metavar="DIR", help="the shard folder to write (or resume)")
    parser.add_argument(
        "--tokenizer",
        default=str(DEFAULT_TOKENIZER_PATH),
        metavar="PATH",
        help="a tiktoken BPE file, or a Hugging Face tokenizer.json or the folder holding it (default: shipped)",
    )
    parser.add_argument("--text-field", default="text", metavar="NAME", help="JSON field or column (default: text)")
    parser.add_argument(
        "--workers", type=_positive_int, default=os.cpu_count() or 1, metavar="N", help="default: the CPU count"
    )
    parser.add_argument(
        "--shard-tokens",
        type=_positive_int,
        default=DEFAULT_SHARD_TOKENS,
        metavar="N",
        help=f"most tokens per shard (default: {DEFAULT_SHARD_TOKENS:,})",
    )
    parser.add_argument("--hf-split", default="train", metavar="NAME", help="dataset split (default: train)")
    parser.add_argument("--num-tasks", type=_positive_int, default=1, metavar="N", help="tasks prepare is split into")
    parser.add_argument("--task-index", type=int, metavar="I", help="this task, 0 to N-1: writes DIR.task-I-of-N")
    parser.add_argument("--merge", action="store_true", help="make DIR of the N tasks' parts (no INPUT)")
    args = parser.parse_args(argv)
    if args.merge and (args.inputs or args.task_index is not None):
        parser.error("--merge takes no INPUT and no --task-index: it reads the parts the tasks wrote")
    if not args.merge and not args.inputs:
        parser.error("give at least one INPUT (or --merge)")
    if args.task_index is not None and not 0 <= args.task_index < args.num_tasks:
        parser.error(f"--task-index must be 0 to {args.num_tasks - 1}, not {args.task_index}")
    return args


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


# ----- inputs -------------------------------------------------------------------------------------


def resolve_inputs(items: list[str], text_field: str, hf_split: str, task: tuple[int, int] | None) -> list[InputSource]:
    """The sources the INPUT arguments name, in order; with `task` = (I, N), only the I-th of N contiguous runs of
    them of about equal bytes (each source counted at its midpoint), the rest never opened."""
    if task is None:
        return [source for item in items for source in resolve_input(item, text_field, hf_split)]
    units = [unit for item in items for unit in _input_units(item)]
    sizes = [unit.stat().st_size if isinstance(unit, Path) else 0 for unit in units]
    total, index, count = max(1, sum(sizes)), *task
    mine, before = [], 0
    for unit, size in zip(units, sizes):
        if index <= (before + size / 2) * count / total < index + 1 or (index == count - 1 and before >= total):
            mine.append(unit)
        before += size
    sources = []
    for unit in mine:
        is_file = isinstance(unit, Path)
        sources += [_file_source(unit, text_field)] if is_file else resolve_input(unit, text_field, hf_split)
    return sources


def _input_units(item: str) -> list[Path | str]:
    """What a task split distributes of one INPUT: each of its files, or the INPUT itself when it is a dataset (not
    read here)."""
    path = Path(item)
    if path.is_dir() and not _is_saved_dataset(path):
        return _files_under(path)
    return [path] if path.is_file() else [item]


def resolve_input(item: str, text_field: str, hf_split: str) -> list[InputSource]:
    """The sources an INPUT argument names, each checked up front (columns, JSON lines) so that a
    bad input fails before any shard is written, when fixing it can still reuse the folder."""
    path = Path(item)
    if path.is_dir() and _is_saved_dataset(path):
        dataset, name = _load_saved_dataset(path, hf_split)
        return [_dataset_source(dataset, name, text_field)]
    if path.is_dir():
        return [_file_source(file, text_field) for file in _files_under(path)]
    if path.is_file():
        return [_file_source(path, text_field)]
    if _looks_like_hub_name(item):
        return [_dataset_source(_load_hub_dataset(item, hf_split), f"{item} [{hf_split}]", text_field)]
    raise TorchpreError(f"Input '{item}' does not exist. {_INPUT_HINT}")


def _files_under(folder: Path) -> list[Path]:
    """Readable files under `folder`, sorted; hidden files and folders (.git, checkpoints) are skipped. A symbolic
    link under it, which could lead anywhere on the machine (into the shards someone publishes), is refused by name:
    the folder's own files are read, or a file named as an INPUT itself."""
    names = sorted(
        str(path.relative_to(folder))
        for path in folder.rglob("*")
        if not any(part.startswith(".") for part in path.relative_to(folder).parts)
    )
    files = [folder / name for name in names if _kind_under(folder, name) == "file"]
    usable = [p for p in files if p.suffix.lower() in SUFFIXES]
    if not usable:
        found = f"{len(files)} other files, e.g. {files[0].name}" if files else "no files"
        raise TorchpreError(f"Folder {folder} holds no {', '.join(SUFFIXES)} files ({found}). {_INPUT_HINT}")
    ignored = [p for p in files if p.suffix.lower() not in SUFFIXES]
    if ignored:
        print(
            f"note: ignoring {len(ignored)} files under {folder} with other suffixes (e.g. {ignored[0].name})",
            file=sys.stderr,
        )
    return usable


def _open_input(path: Path) -> BinaryIO:
    """An input file opened as a regular file (`confined.open_named`: a FIFO would block, a device never ends). A
    file the command names may be a link, the user's choice; a file found in a named folder was shown to be none
    (`_kind_under`)."""
    return open_named(path)


def _kind_under(folder: Path, name: str) -> str:
    kind = file_kind(folder, name)
    if kind == "link":
        raise UntrustedInput(
            f"Input {folder}: {folder / name} is, or leads through, a symbolic link, which could lead out of the "
            "folder. Copy the real file in its place."
        )
    return kind


def _file_source(path: Path, text_field: str) -> InputSource:
    readers = {".txt": _txt_source, ".jsonl": _jsonl_source, ".parquet": _parquet_source}
    reader = readers.get(path.suffix.lower())
    if reader is None:
        raise TorchpreError(f"Input {path} has the unknown suffix '{path.suffix}'. {_INPUT_HINT}")
    return reader(path, text_field)


def _txt_source(path: Path, text_field: str) -> InputSource:
    return InputSource(str(path), (path,), 1, functools.partial(_txt_texts, path))


def _txt_texts(path: Path) -> Iterator[str]:
    with _open_input(path) as file:
        yield file.read().decode("utf-8", errors="replace")


def _jsonl_source(path: Path, text_field: str) -> InputSource:
    records = sum(1 for _ in _jsonl_texts(path, text_field))  # validates every line before any work
    return InputSource(str(path), (path,), records, functools.partial(_jsonl_texts, path, text_field))


def _jsonl_texts(path: Path, text_field: str) -> Iterator[str | None]:
    """The `text_field` of each line, every line bounded and parsed by `json_input.json_lines`."""
    with _open_input(path) as lines:
        for line_number, record in json_lines(lines, path):
            yield _jsonl_text(record, text_field, f"{path}:{line_number}")


def _jsonl_text(record: JsonValue, text_field: str, where: str) -> str | None:
    example = f'Each line of a .jsonl input must be a JSON object like {{"{text_field}": "..."}}'
    if not isinstance(record, dict) or text_field not in record:
        keys = ", ".join(map(repr, record)) if isinstance(record, dict) else f"a {type(record).__name__}"
        raise TorchpreError(
            f"{where} has no '{text_field}' field (found {keys or 'no keys'}). {example}; "
            "pass --text-field NAME to read another field."
        )
    text = record[text_field]
    if text is not None and not isinstance(text, str):
        raise TorchpreError(f"{where}: '{text_field}' holds a {type(text).__name__}, not a string. {example}.")
    return text


def _parquet_source(path: Path, text_field: str) -> InputSource:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise TorchpreError(f"Reading {path} needs pyarrow: pip install pyarrow (or torchpre[hf]).") from None
    with _open_input(path) as opened:
        try:
            file = pq.ParquetFile(opened)
        except (OSError, pa.ArrowException) as error:
            raise TorchpreError(f"{path} is not a readable Parquet file ({error}).") from None
        _check_column(str(path), text_field, {field.name: str(field.type) for field in file.schema_arrow})
        records = file.metadata.num_rows
    return InputSource(str(path), (path,), records, functools.partial(_parquet_texts, path, text_field))


def _parquet_texts(path: Path, text_field: str) -> Iterator[str | None]:
    import pyarrow.parquet as pq

    with _open_input(path) as file:
        for batch in pq.ParquetFile(file).iter_batches(batch_size=1024, columns=[text_field]):
            yield from batch.column(0).to_pylist()


def _check_column(name: str, column: str, types: dict[str, str]) -> None:
    """`column` is among the table's columns (`types`: name -> Arrow type) and holds strings."""
    if column not in types:
        raise TorchpreError(f"{name} has no column '{column}' (columns: {', '.join(types)}). Pass --text-field COLUMN.")
    if types[column] not in ("string", "large_string"):
        raise TorchpreError(f"Column '{column}' of {name} holds {types[column]}, not text. Pass --text-field COLUMN.")


def _dataset_source(dataset: Dataset, name: str, text_field: str) -> InputSource:
    """A `datasets.Dataset`, fingerprinted by its Arrow files."""
    _check_column(name, text_field, {column: str(getattr(f, "dtype", f)) for column, f in dataset.features.items()})
    files = tuple(Path(cache["filename"]) for cache in dataset.cache_files)
    return InputSource(name, files, len(dataset), functools.partial(_dataset_texts, dataset, text_field))


def _dataset_texts(dataset: Dataset, text_field: str) -> Iterator[str | None]:
    for batch in dataset.select_columns([text_field]).iter(batch_size=1024):
        yield from batch[text_field]


def _is_saved_dataset(folder: Path) -> bool:
    """A folder written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk`."""
    return (folder / "dataset_dict.json").is_file() or (
        (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file()
    )


def _import_datasets(what: str) -> ModuleType:
    try:
        import datasets
    except ImportError:
        raise TorchpreError(
            f"Reading {what} needs the `datasets` package: pip install torchpre[hf]. "
            "Or give .txt, .jsonl or .parquet files."
        ) from None
    return datasets


def _load_saved_dataset(folder: Path, split: str) -> tuple[Dataset, str]:
    datasets = _import_datasets(str(folder))
    loaded = datasets.load_from_disk(str(folder))
    if not isinstance(loaded, datasets.DatasetDict):
        return loaded, str(folder)
    if split not in loaded:
        raise TorchpreError(f"{folder} has the splits {', '.join(loaded)}, not '{split}'. Pass --hf-split NAME.")
    return loaded[split], f"{folder} [{split}]"


def _looks_like_hub_name(item: str) -> bool:
    """`name` or `owner/name`, and not a file name with one of our suffixes (then it is a missing file)."""
    return bool(re.fullmatch(r"[\w.-]+(/[\w.-]+)?", item)) and Path(item).suffix.lower() not in SUFFIXES


def _load_hub_dataset(name: str, split: str) -> Dataset:
    """`datasets.load_dataset(name, split=split)`, from the local cache when the Hub is out of reach."""
    datasets = _import_datasets(f"the Hugging Face dataset '{name}'")
    offline_reason = _hub_offline_reason()
    try:
        with _hub_offline(offline_reason is not None):
            return datasets.load_dataset(name, split=split)
    except (OSError, ValueError) as error:  # ConnectionError, DatasetNotFoundError, unknown split
        if offline_reason:
            raise TorchpreError(
                f"'{name}' is not a local file or folder, and the Hugging Face dataset '{name}' is not in the "
                f"local cache while offline ({offline_reason}; datasets says: {error}). Download it where the Hub "
                "is reachable, e.g. "
                f"`datasets.load_dataset('{name}', split='{split}').save_to_disk(DIR)`, and give that local DIR "
                "(or .txt/.jsonl/.parquet files) as the input."
            ) from None
        raise TorchpreError(
            f"'{name}' is not a local file or folder, and loading it as a Hugging Face dataset (split '{split}') "
            f"failed: {error}. Check the path, or the dataset name and --hf-split. {_INPUT_HINT}"
        ) from None


def _hub_offline_reason() -> str | None:
    """Why the Hub cannot be used (None if it can). Checked up front because `datasets` retries an
    unreachable Hub for half a minute before failing."""
    for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(variable, "").upper() in ("1", "ON", "YES", "TRUE"):
            return f"{variable}={os.environ[variable]}"
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    if not _reachable(endpoint, _HUB_PROBE_TIMEOUT_S):
        return f"{endpoint} is unreachable"
    return None


def _reachable(url: str, timeout: float) -> bool:
    """Whether a TCP connection to `url`'s host (or its proxy) opens within `timeout`, DNS included."""
    parts = urllib.parse.urlsplit(url)
    proxy = urllib.request.getproxies().get(parts.scheme)
    if proxy and not urllib.request.proxy_bypass(parts.hostname or ""):
        parts = urllib.parse.urlsplit(proxy)
    address = (parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
    connected = threading.Event()

    def connect() -> None:
        with contextlib.suppress(OSError), socket.create_connection(address, timeout=timeout):
            connected.set()

    threading.Thread(target=connect, daemon=True).start()  # daemon: a hung DNS lookup cannot block exit
    return connected.wait(timeout)


@contextlib.contextmanager
def _hub_offline(enabled: bool) -> Iterator[None]:
    """Offline mode for `datasets` and `huggingface_hub`, which read HF_HUB_OFFLINE only when imported."""
    if not enabled:
        yield
        return
    import datasets.config
    import huggingface_hub.constants

    modules = (datasets.config, huggingface_hub.constants)
    saved = [module.HF_HUB_OFFLINE for module in modules]
    for module in modules:
        module.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        for module, value in zip(modules, saved):
            module.HF_HUB_OFFLINE = value


def _fingerprint(source: InputSource) -> dict:
    """What identifies a source's content independently of where it lies: sizes and a SHA-256."""
    digest = hashlib.sha256()
    size = 0
    for path in source.files:
        with _open_input(path) as file:
            while chunk := file.read(1 << 20):
                digest.update(chunk)
                size += len(chunk)
    return {"name": source.name, "records": source.records, "bytes": size, "sha256": digest.hexdigest()}


# ----- the output folder --------------------------------------------------------------------------


def open_output(folder: Path, tokenizer: Tokenizer, record: dict) -> Manifest:
    """The manifest to continue from: the folder's own when it holds shards of the same inputs, options and
    tokenizer (cut back to its intact shards), else a fresh one. Refuses a folder holding anything else."""
    if folder.exists() and not folder.is_dir():
        raise TorchpreError(f"--output {folder} is a file, not a folder. Give a new or empty folder.")
    folder.mkdir(parents=True, exist_ok=True)
    sha256 = tokenizer.sha256
    if file_kind(folder, MANIFEST) != "missing":  # a link or a folder there: Manifest.read refuses it by name
        try:
            existing = Manifest.read(folder)
        except TorchpreError as error:
            raise TorchpreError(f"{error} Or delete {folder}, or choose another --output folder.") from None
        if existing.shards:  # without shards there is nothing to reuse, so nothing to protect
            _check_same_dataset(folder, existing, sha256, tokenizer.path, record)
            manifest = _keep_intact_shards(folder, existing)
            if not manifest.complete:
                _restart_journal(folder, manifest)
            return manifest
    elif any(folder.iterdir()):
        raise TorchpreError(
            f"--output {folder} is not empty and holds no {MANIFEST}, so it is not a shard folder. "
            "Give a new or empty folder."
        )
    manifest = Manifest(tokenizer.name, sha256, tokenizer.vocab_size, complete=False, source=record)
    _restart_journal(folder, manifest)
    return manifest


def _restart_journal(folder: Path, manifest: Manifest) -> None:
    """`manifest` written with every shard it lists, and an empty journal to list the next ones in. The journal goes
    first: a crash in between leaves its shards unlisted (written again), never listed twice."""
    (folder / JOURNAL).unlink(missing_ok=True)
    manifest.write(folder)


def _check_same_dataset(folder: Path, manifest: Manifest, sha256: str, tokenizer: Path, record: dict) -> None:
    start_over = f"Choose another --output folder, or delete {folder} to start over."
    if manifest.tokenizer_sha256 != sha256:
        raise TorchpreError(
            f"{folder} holds shards made with the tokenizer '{manifest.tokenizer_name}' (sha256 "
            f"{manifest.tokenizer_sha256[:12]}...), not with --tokenizer {tokenizer} (sha256 {sha256[:12]}...). "
            + start_over
        )
    difference = _source_difference(manifest.source, record)
    if difference:
        raise TorchpreError(f"{folder} holds shards of a different dataset: {difference}. {start_over}")


def _source_difference(old: dict, new: dict) -> str | None:
    """The first way `new` inputs and options differ from `old` ones, in words; paths may differ."""
    if not old:
        return "its manifest does not say what they were made from (it was not written by prepare)"
    if old.get("prepare_version") != new["prepare_version"]:
        return f"they were made by prepare version {old.get('prepare_version')}, this is {new['prepare_version']}"
    for key, value in new["options"].items():
        if old["options"].get(key) != value:
            flag = "--" + key.replace("_", "-")
            return f"they were made with {flag} {old['options'].get(key)}, not {value}"
    old_inputs, new_inputs = old["inputs"], new["inputs"]
    for index, (was, now) in enumerate(zip(old_inputs, new_inputs)):
        if any(was[key] != now[key] for key in ("records", "bytes", "sha256")):
            return f"input {index + 1}, {_describe(now)}, differs from the one they were made from, {_describe(was)}"
    if len(old_inputs) != len(new_inputs):
        return f"they were made from {len(old_inputs)} inputs, not {len(new_inputs)}"
    return None


def _describe(fingerprint: dict) -> str:
    return f"{fingerprint['name']} ({fingerprint['bytes']:,} bytes, sha256 {fingerprint['sha256'][:12]}...)"


def _keep_intact_shards(folder: Path, manifest: Manifest) -> Manifest:
    """Drops the first shard whose files are damaged, and all after it, so that they are written again."""
    for index, shard in enumerate(manifest.shards):
        problem = shard_file_problem(folder, manifest, shard)
        if problem:
            print(f"note: {problem}; writing it and the shards after it again.", file=sys.stderr)
            manifest.shards = manifest.shards[:index]
            manifest.complete = False
            break
    return manifest


# ----- tokenizing and writing ---------------------------------------------------------------------


def write_shards(
    sources: list[InputSource],
    manifest: Manifest,
    folder: Path,
    tokenizer: Tokenizer,
    workers: int,
    shard_tokens: int,
    may_be_empty: bool = False,
) -> Stats:
    """Tokenizes the documents after those of the shards already in `manifest` and writes the remaining
    shards, listing each in the journal as it is written; writes the manifest, complete, at the end. Inputs without
    text are an error, unless they are a task's part (`may_be_empty`)."""
    records = itertools.chain.from_iterable(source.texts() for source in sources)
    stats = Stats()
    started = time.perf_counter()
    total = sum(source.records for source in sources)
    with (
        open_for_append(folder / JOURNAL) as journal,
        tqdm(total=total, unit="doc", desc="tokenizing", mininterval=0.5, smoothing=0.1) as bar,
    ):
        writer = _ShardWriter(folder, manifest, shard_tokens, journal)
        documents = _skip_documents(records, manifest.num_documents, bar)
        for batch, tokens, lengths in _tokenize(_batches(documents), tokenizer, workers):
            writer.add(tokens, lengths)
            stats.documents += len(batch.texts)
            stats.tokens += len(tokens)
            stats.text_bytes += batch.text_bytes
            bar.update(batch.records)
            bar.set_postfix_str(f"{stats.tokens / (time.perf_counter() - started):,.0f} tokens/s", refresh=False)
        writer.flush()
    stats.shards = writer.written
    if manifest.num_documents == 0 and not may_be_empty:
        names = ", ".join(source.name for source in sources)
        raise TorchpreError(f"The inputs ({names}) hold no text: every document is empty. {_INPUT_HINT}")
    _finish(folder, manifest)
    return stats


def _finish(folder: Path, manifest: Manifest) -> None:
    """`manifest` written complete, listing every shard, and the journal that listed them meanwhile removed."""
    manifest.complete = True
    manifest.write(folder)
    (folder / JOURNAL).unlink()


# ----- prepare across machines --------------------------------------------------------------------


def task_folder(output: Path, index: int, count: int) -> Path:
    """Where task `index` of `count` writes its part: a shard folder beside `output`."""
    return output.with_name(f"{output.name}.task-{index:05d}-of-{count:05d}")


def merge(folder: Path, count: int, tokenizer: Tokenizer) -> None:
    """Writes `folder` from the `count` tasks' parts: their documents in task order cut into shards by the rule one
    task applies (`_ShardWriter`), and a manifest recording the inputs of all of them, so that `folder` is byte for
    byte the folder one `prepare` of the same inputs writes. Resumable as prepare is."""
    parts = [_finished_part(folder, index, count, tokenizer) for index in range(count)]
    first = parts[0][1].source
    options = {key: value for key, value in first["options"].items() if key not in ("num_tasks", "task_index")}
    inputs = [fingerprint for _, part in parts for fingerprint in part.source["inputs"]]
    manifest = open_output(folder, tokenizer, {"prepare_version": first["prepare_version"], "options": options,
                                               "inputs": inputs})  # fmt: skip
    if manifest.complete:
        print(f"{folder} already holds the merge of the {count} tasks' parts: nothing to do.")
        return
    skip = manifest.num_documents
    with open_for_append(folder / JOURNAL) as journal:
        writer = _ShardWriter(folder, manifest, options["shard_tokens"], journal)
        for part_folder, part in parts:
            for index, shard in enumerate(part.shards):
                if skip >= shard.num_documents:
                    skip -= shard.num_documents
                    continue
                tokens, lengths = _part_documents(part_folder, part, index)
                writer.add(tokens[int(lengths[:skip].sum()) :], lengths[skip:])
                skip = 0
        writer.flush()
    if manifest.num_documents == 0:
        raise TorchpreError(f"The {count} tasks' parts of {folder} hold no documents. {_INPUT_HINT}")
    _finish(folder, manifest)
    print(f"Merged the parts of {count} tasks into {folder}: {len(manifest.shards)} shards, "
          f"{manifest.num_documents:,} documents, {manifest.num_tokens:,} tokens.")  # fmt: skip


def _finished_part(folder: Path, index: int, count: int, tokenizer: Tokenizer) -> tuple[Path, Manifest]:
    """Task `index`'s part folder and manifest, shown to be complete, made with `tokenizer`, by task `index` of
    `count`, with the options of the others."""
    part_folder = task_folder(folder, index, count)
    rerun = f"Run `{PROG} INPUT... --output {folder} --num-tasks {count} --task-index {index}` (again) first."
    if not part_folder.is_dir():
        raise TorchpreError(f"Task {index} of {count} has written no part: {part_folder} does not exist. {rerun}")
    part = Manifest.read(part_folder)
    options = part.source.get("options", {}) if isinstance(part.source.get("options"), dict) else {}
    if not part.complete:
        raise TorchpreError(f"Task {index} of {count} has not finished its part {part_folder}. {rerun}")
    if (options.get("task_index"), options.get("num_tasks")) != (index, count):
        raise TorchpreError(
            f"{part_folder / MANIFEST} records task {options.get('task_index')} of {options.get('num_tasks')}, not "
            f"task {index} of {count}. {rerun}"
        )
    if part.tokenizer_sha256 != tokenizer.sha256:
        raise TorchpreError(
            f"{part_folder} was made with the tokenizer '{part.tokenizer_name}' (sha256 {part.tokenizer_sha256[:12]}"
            f"...), not with --tokenizer {tokenizer.path}. Merge with the tokenizer the tasks used."
        )
    if not isinstance(part.source.get("inputs"), list) or "shard_tokens" not in options:
        raise TorchpreError(f"{part_folder / MANIFEST} does not say what its part was made from. {rerun}")
    return part_folder, part


def _part_documents(folder: Path, part: Manifest, index: int) -> tuple[np.ndarray, np.ndarray]:
    """The tokens of shard `index` of a task's part and its documents' lengths, read whole from the checked files;
    offsets that do not cut the tokens into non-empty documents are an error naming the file."""
    shard = part.shards[index]
    try:
        with open_tokens(folder, part, index) as file:
            tokens = read_array(file, folder / f"{shard.name}.bin", part.dtype, 0, shard.num_tokens)
        with open_offsets(folder, part, index) as file:
            offsets = read_array(file, folder / f"{shard.name}.idx", _OFFSETS, 0, shard.num_documents + 1)
    except DamagedShard as problem:
        raise TorchpreError(f"{problem}. Run that task again, then merge.") from None
    lengths = np.diff(offsets)
    if offsets[0] != 0 or offsets[-1] != shard.num_tokens or (lengths <= 0).any():
        raise TorchpreError(
            f"{folder / f'{shard.name}.idx'} does not cut the {shard.num_tokens:,} tokens of its shard into documents "
            "(offsets from 0 to the end, each after the last). Run that task again, then merge."
        )
    return tokens, lengths


def _skip_documents(records: Iterator[str | None], count: int, bar: tqdm) -> Iterator[str | None]:
    """`records` after the first `count` documents (those of the shards already written), unread by the
    tokenizer."""
    for text in records:
        if count == 0:
            yield text
            yield from records
            return
        bar.update(1)
        if text and not text.isspace():
            count -= 1


def _batches(records: Iterable[str | None]) -> Iterator[Batch]:
    """Consecutive documents of about _BATCH_BYTES of text; empty records only count as progress."""
    texts: list[str] = []
    count = size = 0
    for text in records:
        count += 1
        if text and not text.isspace():
            texts.append(text)
            size += len(text.encode("utf-8", errors="replace"))
        if size >= _BATCH_BYTES:
            yield Batch(texts, count, size)
            texts, count, size = [], 0, 0
    if count:
        yield Batch(texts, count, size)


def encode_documents(tokenizer: Tokenizer, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The framed ids of all `texts` back to back, and each one's length: arrays, which cross process
    boundaries far faster than lists of ints."""
    ids = [tokenizer.encode(text, bos=True, eos=True) for text in texts]
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    dtype = token_dtype(tokenizer.vocab_size)
    tokens = np.concatenate([np.array(document, dtype) for document in ids]) if ids else np.empty(0, dtype)
    return tokens, lengths


def _tokenize(batches: Iterator[Batch], tokenizer: Tokenizer, workers: int) -> Iterator[Encoded]:
    """Each batch with its encoding, in input order. With several workers, a bounded number of batches
    is in flight (Pool.imap would read the whole input ahead into memory)."""
    if workers == 1:  # in this process: one core, as asked, and no start-up cost
        for batch in batches:
            yield batch, *encode_documents(tokenizer, batch.texts)
        return
    # spawn: workers start clean whatever this process holds (threads, imported libraries).
    context = multiprocessing.get_context("spawn")
    with context.Pool(workers, initializer=_init_worker, initargs=(tokenizer,)) as pool:
        pending: deque = deque()
        for batch in batches:
            pending.append((batch, pool.apply_async(_encode_in_worker, (batch.texts,))))
            if len(pending) >= workers * _IN_FLIGHT_PER_WORKER:
                done, result = pending.popleft()
                yield done, *result.get()
        while pending:
            done, result = pending.popleft()
            yield done, *result.get()


_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer: Tokenizer) -> None:
    """Receives the parent's tokenizer (not its path: the file could change) and leaves Ctrl-C to the parent."""
    global _worker_tokenizer
    _worker_tokenizer = tokenizer
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    assert _worker_tokenizer is not None, "the pool initializer sets it"
    return encode_documents(_worker_tokenizer, texts)


class _ShardWriter:
    """Cuts the stream of documents into shards of at most `shard_tokens` tokens (a longer document
    gets its own shard), only between documents, and lists each shard in `journal` once written.
    The cut depends only on the documents, so shard N is the same in every run."""

    def __init__(self, folder: Path, manifest: Manifest, shard_tokens: int, journal: BinaryIO) -> None:
        self.folder = folder
        self.manifest = manifest
        self.shard_tokens = shard_tokens
        self.journal = journal
        self.documents: list[np.ndarray] = []
        self.tokens = 0
        self.written = 0

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        ends = np.cumsum(lengths).tolist()
        for start, end in zip([0, *ends[:-1]], ends):
            if self.documents and self.tokens + end - start > self.shard_tokens:
                self.flush()
            self.documents.append(tokens[start:end])
            self.tokens += end - start

    def flush(self) -> None:
        if not self.documents:
            return
        index = len(self.manifest.shards)
        shard = write_shard(self.folder, f"shard_{index:05d}", self.documents, self.manifest.vocab_size)
        self.journal.write(journal_line(index, shard))
        self.journal.flush()
        self.manifest.shards.append(shard)
        self.documents, self.tokens = [], 0
        self.written += 1


def _summary(manifest: Manifest, folder: Path, stats: Stats, resumed_shards: int, seconds: float, workers: int) -> str:
    resumed = f", resumed after {resumed_shards} shards already written" if resumed_shards else ""
    megabytes = stats.text_bytes / 1e6
    plural = "s" if workers > 1 else ""
    tokens_per_s = stats.tokens / seconds
    mb_per_s = megabytes / seconds
    return (
        f"Wrote {stats.shards} shards to {folder}{resumed}; it holds {len(manifest.shards)} shards, "
        f"{manifest.num_documents:,} documents, {manifest.num_tokens:,} tokens.\n"
        f"This run: {stats.documents:,} documents, {stats.tokens:,} tokens from {megabytes:,.2f} MB of text "
        f"in {seconds:.1f} s: {tokens_per_s:,.0f} tokens/s, {mb_per_s:.2f} MB/s with {workers} worker{plural} "
        f"({tokens_per_s / workers:,.0f} tokens/s, {mb_per_s / workers:.2f} MB/s per core)."
    )


if __name__ == "__main__":
    from torchpre.runtime.cli import run_entry_point

    run_entry_point(main, sys.argv[1:], prog=PROG)
