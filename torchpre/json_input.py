"""JSON written by someone else, parsed within bounds: its size is checked before it is read, the digits of its
integers while it is parsed, and its nesting depth after (the parser itself stops at Python's recursion limit), so
that a hostile file ends in one message naming it instead of a RecursionError, a ValueError of Python's
integer-string limit, or memory exhausted (docs/security.md).

Each format torchpre reads from others has its size bound here (`LIMITS`); the fields are checked by its reader.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, TypeAlias, Union

from torchpre.confined import read_file, read_named
from torchpre.errors import UntrustedInput

MAX_DEPTH = 64  # the deepest any format torchpre reads nests is 6 (a tokenizer.json's model)
MAX_INTEGER_DIGITS = 30  # an int64 has 19; sizes, steps and ids fit with room to spare

MiB = 1 << 20
# The largest file of each kind torchpre parses: far above what any genuine one holds (a 405B checkpoint's manifest is
# a few MB; a released tokenizer.json under 20 MB).
LIMITS = {
    "manifest": 256 * MiB,
    "state": 64 * MiB,
    "metadata": 1024 * MiB,
    "config": 16 * MiB,
    "index": 256 * MiB,
    "shard_manifest": 1024 * MiB,
    "tokenizer": 256 * MiB,
    "tiktoken": 64 * MiB,  # a tiktoken BPE file, read whole into a dict: o200k_base's is 3.6 MB
    "line": 16 * MiB,
}

# What `loads` returns: JSON's values as `json.loads` builds them (a number without a fraction or exponent as an int).
# A reader narrows it field by field (`errors.json_field`, isinstance) before it trusts any of it.
JsonValue: TypeAlias = Union[None, bool, int, float, str, list["JsonValue"], dict[str, "JsonValue"]]


def loads(data: bytes, source: Path, where: str = "") -> JsonValue:
    """`data` (UTF-8 JSON from the file `source`; `where`, e.g. "line 3", says where in it) parsed, once its nesting
    is shown to be at most MAX_DEPTH deep; integers of more than MAX_INTEGER_DIGITS digits are refused. NaN and
    Infinity parse as floats (torchpre writes them); the reader decides where a field may hold one. An UntrustedInput
    error names `source` for anything that is not such JSON."""
    at = f" ({where})" if where else ""
    try:
        value = json.loads(data.decode("utf-8"), parse_int=_bounded_int, parse_constant=_constant)
    except RecursionError:
        raise _too_deep(source, at, "more than a thousand") from None
    except UnicodeDecodeError as error:
        raise UntrustedInput(f"{source}{at} is not UTF-8 text (byte {error.start}): it is no JSON file.") from None
    except _TooManyDigits as error:
        raise UntrustedInput(
            f"{source}{at} holds an integer of {error.args[0]:,} digits; no field of a file torchpre reads needs more "
            f"than {MAX_INTEGER_DIGITS}. It was not written by torchpre or its peers, or was altered."
        ) from None
    except json.JSONDecodeError as error:
        raise UntrustedInput(f"{source}{at} is not valid JSON ({error}).") from None
    depth = nesting_depth(value)
    if depth > MAX_DEPTH:
        raise _too_deep(source, at, str(depth))
    return value


def _too_deep(source: Path, at: str, levels: str) -> UntrustedInput:
    return UntrustedInput(
        f"{source}{at} nests {levels} levels deep; no file torchpre reads nests more than {MAX_DEPTH}. It was not "
        "written by torchpre or its peers, or was altered (docs/security.md)."
    )


def read_named_json(path: Path, kind: str) -> JsonValue:
    """The JSON file the user named `path` (`confined.read_named`: a link followed, a regular file, bounded by
    `LIMITS[kind]`), parsed by `loads`. FileNotFoundError when it is missing."""
    return loads(read_named(path, LIMITS[kind]), path)


def read_json(folder: Path, name: str, kind: str, source: Path | None = None, entry: str = "") -> JsonValue:
    """The JSON file `folder/name`, opened by `confined.read_file` (no symbolic link, a regular file, at most
    `LIMITS[kind]` bytes) and parsed by `loads`. FileNotFoundError when it is missing."""
    return loads(read_file(folder, name, LIMITS[kind], source, entry), folder / name)


def json_lines(file: BinaryIO, source: Path) -> Iterator[tuple[int, JsonValue]]:
    """(line number, value) of each non-blank line of the JSON Lines `file` (the file `source`), each line refused
    (UntrustedInput naming `source` and the line) past `LIMITS["line"]` bytes before anything of it is kept, then
    parsed by `loads`: a file of records from others is bounded line by line, not as a whole."""
    limit = LIMITS["line"]
    for number, line in enumerate(iter(lambda: file.readline(limit + 1), b""), start=1):
        if len(line) > limit and not line.endswith(b"\n"):
            raise UntrustedInput(
                f"{source} (line {number}) holds more than {limit:,} bytes; no record of a JSON Lines file torchpre "
                "reads needs that many. Split the record, or fix the file."
            )
        if line.strip():
            yield number, loads(line, source, f"line {number}")


def nesting_depth(value: JsonValue) -> int:
    """How deep arrays and objects nest in the parsed JSON `value` (0 for a number or string), walked without
    recursion."""
    deepest, pending = 0, [(value, 0)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, depth + 1)
            pending.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


class _TooManyDigits(ValueError):
    pass


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INTEGER_DIGITS:
        raise _TooManyDigits(digits)
    return int(text)


def _constant(name: str) -> float:
    return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}[name]
