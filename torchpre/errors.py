"""User-facing errors.

A `TorchpreError` carries a message written for the person running the job: it names the key,
file or value at fault and says what to change. Entry points print it as one paragraph and exit
non-zero instead of showing a traceback.
"""

import json
from collections.abc import Callable
from typing import TypeAlias, TypeVar, Union, overload

_Step = TypeVar("_Step", bound=Callable[..., object])


class TorchpreError(Exception):
    """An error caused by the user's input (config, files, layout), not by a bug."""


class ConfigError(TorchpreError):
    """A config key is unknown, has the wrong type, or holds an impossible value."""


class InputFileError(TorchpreError):
    """A file the job reads holds what it cannot use (an eval task's line, a released folder's config.json or
    weights, a hardware profile): the file is at fault, not a key's value, so no resolve step can check it earlier."""


def resolve_step(step: _Step) -> _Step:
    """Marks `step` as a config section's resolve step (docs/architecture.md, "Where a key is checked"): it reads
    the section's keys together, raises their ConfigError before any work and returns what the job reads; preflight
    runs it. tests/unit/test_config_error_homes.py finds the steps by this mark and counts the raises elsewhere."""
    return step


class StorageError(TorchpreError):
    """A checkpoint could not be written: its file system is full, read-only or failing. Not the input's fault, so
    entry points exit with a code of its own."""


class UntrustedInput(TorchpreError):
    """A file holds what no file torchpre or its peers write may hold: code to run on load, or a name of a file
    outside its folder (docs/security.md). Never skipped as damage: the job stops."""


class FieldError(TorchpreError):
    """A field of a JSON record (a manifest) is missing or holds the wrong type; the reader adds the file's name."""


_JSON_TYPES = {bool: "true or false", int: "an integer", float: "a number", str: "a string", list: "an array",
               dict: "an object", type(None): "null"}  # fmt: skip
_REQUIRED = object()
FieldValue = TypeVar("FieldValue")
Default = TypeVar("Default")
Kinds: TypeAlias = Union[type[FieldValue], tuple[type[FieldValue], ...]]  # the types a field may hold


# A field's type is the kinds asked for, or the default's: `json_field(record, "size", int)` is an int.
@overload
def json_field(record: object, key: str, kinds: Kinds[FieldValue], where: str = "") -> FieldValue: ...
@overload
def json_field(
    record: object, key: str, kinds: Kinds[FieldValue], where: str, default: Default
) -> FieldValue | Default: ...
@overload
def json_field(record: object, key: str, kinds: Kinds[FieldValue], *, default: Default) -> FieldValue | Default: ...
def json_field(
    record: object, key: str, kinds: type | tuple[type, ...], where: str = "", default: object = _REQUIRED
) -> object:
    """`record[key]` if it holds one of `kinds` (JSON's types: a bool is no integer, an integer is a number), or
    `default` when the key is absent and a default is given; otherwise a FieldError naming the key by its path in
    the file (`where`, e.g. "shards[0]", is the path of `record`) and what it holds instead."""
    name = f"{where}.{key}" if where else key
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if not isinstance(record, dict):
        raise FieldError(f"'{where or 'the file'}' is {_describe(record)}, not an object")
    if key not in record:
        if default is not _REQUIRED:
            return default
        raise FieldError(f"'{name}' is missing")
    value = record[key]
    accepted = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if not accepted and not (float in kinds and type(value) is int):
        expected = " or ".join(_JSON_TYPES.get(kind, kind.__name__) for kind in kinds)
        raise FieldError(f"'{name}' is {_describe(value)}, not {expected}")
    return value


def _describe(value: object) -> str:
    """A JSON value as the file shows it, shortened: null, "abc", 12, [...]."""
    text = json.dumps(value)
    return text if len(text) <= 40 else f"{text[:37]}..."
