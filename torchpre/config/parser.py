"""Command-line and TOML parsing for nested dataclass configs.

A config is a dataclass whose fields are section dataclasses (sections may nest further). Every
other field is an option named by its dotted path, e.g. ``training.steps``, and needs a default.
Values resolve with precedence command line > TOML file (``--job.config_file``, when the config
has that field) > dataclass defaults, and every mistake raises a `ConfigError` that names the key,
where the value came from and, for unknown names, the closest valid one.

Option types: ``str``, ``int``, ``float``, ``bool``, ``Literal`` of strings, ``list[T]`` and
``dict[str, T]`` of those, and ``X | None`` of any of these; and ``list[D]`` of a dataclass ``D`` of
such options, a TOML array of tables (``[[section.key]]``), set in the file only. Ints are accepted
for floats; bools are not ints and floats are not ints. On the command line:

- ``--a.b value`` or ``--a.b=value``; a bool also takes a bare ``--a.b`` (true), or
  true/false, 1/0, yes/no;
- lists are comma separated (``a,b,c``; an empty value is the empty list) and dicts are
  ``name=0.7,other=0.3``;
- ``none`` sets an optional field to None, unless ``"none"`` is itself a valid value of the field
  (``str | None``, or a ``Literal`` that lists it); then it is that string.

TOML has no null: an optional field left out of the file keeps its default, and `to_toml` writes
None values as comments. A dump therefore round-trips exactly when optional fields default to None.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import os
import sys
import types
from typing import TYPE_CHECKING, Iterator, Literal, TypeAlias, TypeVar, Union, get_args, get_origin, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

from torchpre.errors import ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["CONFIG_FILE_KEY", "HelpRequested", "format_help", "format_reference", "parse_args", "to_dict", "to_toml"]

T = TypeVar("T")

# A value as tomllib reads it; the command line gives text (a str), which `_coerce` parses.
TomlValue: TypeAlias = Union[
    str, int, float, bool, datetime.datetime, datetime.date, datetime.time, list["TomlValue"], dict[str, "TomlValue"]
]
# An option's value once resolved: a scalar, None, a list or dict of them, or a list of a table's dataclasses.
OptionValue: TypeAlias = Union[
    None, bool, int, float, str, list["OptionValue"], dict[str, "OptionValue"], list["DataclassInstance"]
]
# A field's type as its annotation spells it: a class (int) or a typing form that is no class (list[str],
# Literal["a", "b"], int | None). Python has no type for both (PEP 747's TypeForm is a draft): get_origin, get_args
# and the checks below narrow it.
TypeForm: TypeAlias = object

CONFIG_FILE_KEY = "job.config_file"
_CLI = "on the command line"
_BOOL_WORDS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
_TOML_ESCAPES = {i: f"\\u{i:04x}" for i in [*range(0x20), 0x7F]} | {
    ord('"'): '\\"',
    ord("\\"): "\\\\",
    ord("\n"): "\\n",
    ord("\t"): "\\t",
}
_HELP_INTRO = """\
Values come from the defaults, then the TOML file, then the command line (highest precedence).
Forms: --section.key value | --section.key=value | bare --section.key for a true bool |
true/false, 1/0, yes/no for bools | a,b,c for lists | name=0.7,other=0.3 for dicts |
none to unset an optional value."""


_HELP_COLUMN = 72


class HelpRequested(Exception):
    """Raised by `parse_args` when argv holds ``-h`` or ``--help``.

    Printing help belongs to the entry point, which knows its program name: catch this, print
    ``format_help(error.config_cls, prog)`` and exit 0. `config_cls` is the config that was being parsed
    (None when the entry point printed its own help).
    """

    def __init__(self, config_cls: type | None = None):
        super().__init__()
        self.config_cls = config_cls


class _BadValue(Exception):
    """A value does not fit its type; the caller adds the key and the source to the message."""


@dataclasses.dataclass(frozen=True)
class _Option:
    """One leaf field of the config, named by its dotted path."""

    key: str
    type: TypeForm
    type_name: str
    default: OptionValue
    help: str


def parse_args(config_cls: type[T], argv: list[str]) -> T:
    """Resolve a config from its defaults, the TOML file and the command-line overrides in `argv`.

    Raises `HelpRequested` when argv asks for help (before looking at anything else) and
    `ConfigError` on any bad input.
    """
    if any(arg in ("-h", "--help") for arg in argv):
        raise HelpRequested(config_cls)
    options = _options(config_cls)
    overrides = _from_cli(argv, options)
    values = {key: option.default for key, option in options.items()}
    path = overrides.get(CONFIG_FILE_KEY, values.get(CONFIG_FILE_KEY))
    if path:
        values |= _from_toml(_load_toml(path), options, f"in {path}")
    return _build(config_cls, values | overrides)


def format_help(config_cls: type, prog: str) -> str:
    """The ``--help`` text: a usage line, then every option by section with type, default and doc."""
    options = _options(config_cls)
    config_file = f" [--{CONFIG_FILE_KEY} PATH]" if CONFIG_FILE_KEY in options else ""
    lines = [f"usage: {prog}{config_file} [--section.key VALUE ...]", "", _HELP_INTRO]
    sections: dict[str, list[_Option]] = {"": []}  # options outside any section first
    for option in options.values():
        sections.setdefault(option.key.rpartition(".")[0], []).append(option)
    for section, members in sections.items():
        if not members:
            continue
        lines += ["", f"[{section}]"] if section else [""]
        usages = [f"  --{o.key} {o.type_name} (default: {_show(o.default)})" for o in members]
        # A very long usage (a Literal with many choices) gets its doc on the next line instead
        # of pushing every doc in the section to the right.
        width = max((len(u) for u in usages if len(u) <= _HELP_COLUMN), default=_HELP_COLUMN)
        for usage, option in zip(usages, members):
            if len(usage) > width:
                lines += [usage, f"{'':{width}}  {option.help}".rstrip()]
            else:
                lines.append(f"{usage.ljust(width)}  {option.help}".rstrip())
    return "\n".join(lines) + "\n"


def format_reference(config_cls: type, skip: type | None = None) -> str:
    """Every option of `config_cls` as Markdown tables, a section each (with the section class's docstring), with
    the type, default and doc ``--help`` prints; options that `skip` also has are left out (a config that extends
    another documents only its own)."""
    skipped = set(_options(skip)) if skip else set()
    sections: dict[str, list[_Option]] = {}
    for option in _options(config_cls).values():
        if option.key not in skipped:
            sections.setdefault(option.key.rpartition(".")[0], []).append(option)
    lines = []
    for section, members in sections.items():
        if section:
            cls = _section_class(config_cls, section)
            lines += [f"### [{section}]", "", *([cls.__doc__.strip(), ""] if _has_docstring(cls) else [])]
        lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for o in members:
            cells = (f"`--{o.key}`", _cell(o.type_name), f"`{_cell(_show(o.default))}`", _cell(o.help))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        for o in members:
            if (table := _table_type(o.type)) is not None:
                lines += _table_reference(o.key, table)
    return "\n".join(lines)


def _table_reference(key: str, cls: type) -> list[str]:
    """The keys of each table of a ``list[D]`` option (`key`), as `format_reference` lists a section's."""
    doc = [cls.__doc__.strip(), ""] if _has_docstring(cls) else []
    lines = [f"#### [[{key}]]", "", *doc, "| key | type | default | meaning |", "|---|---|---|---|"]
    for o in _options(cls).values():
        cells = (f"`{o.key}`", _cell(o.type_name), f"`{_cell(_show(o.default))}`", _cell(o.help))
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def _section_class(config_cls: type, section: str) -> type:
    cls = config_cls
    for name in section.split("."):
        cls = get_type_hints(cls)[name]
    return cls


def _has_docstring(cls: type) -> bool:
    """Whether `cls` has its own docstring (a dataclass without one gets its signature as __doc__)."""
    return bool(cls.__doc__) and not cls.__doc__.startswith(f"{cls.__name__}(")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def to_toml(config: DataclassInstance) -> str:
    """The config as TOML text, which `parse_args` reads back to an equal config.

    Sections become tables. None values are written as comments because TOML has no null; read
    back, such a field takes its default.
    """
    return "\n\n".join(_toml_blocks(config, "")) + "\n"


def to_dict(config: DataclassInstance) -> dict[str, OptionValue]:
    """The config as nested plain dicts, e.g. for experiment trackers."""
    return dataclasses.asdict(config)


# ----- the option tree ---------------------------------------------------------------------------


def _options(config_cls: type) -> dict[str, _Option]:
    """Every leaf option in declaration order; defaults come from a default instance, so a section
    whose ``default_factory`` customizes its fields shows those values."""
    return {option.key: option for option in _walk(config_cls, config_cls(), "")}


def _walk(cls: type, instance: DataclassInstance, prefix: str) -> Iterator[_Option]:
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key, tp, value = prefix + f.name, hints[f.name], getattr(instance, f.name)
        if dataclasses.is_dataclass(tp):
            yield from _walk(tp, value, key + ".")
            continue
        try:
            type_name = _type_name(tp)
        except TypeError as e:
            raise TypeError(f"config field '{key}': {e}") from None
        yield _Option(key, tp, type_name, value, f.metadata.get("help", ""))


def _build(cls: type[T], values: dict[str, OptionValue], prefix: str = "") -> T:
    """Instantiate `cls` and its sections from a complete {dotted key: value} mapping."""
    hints = get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.init:
            tp, key = hints[f.name], prefix + f.name
            kwargs[f.name] = _build(tp, values, key + ".") if dataclasses.is_dataclass(tp) else values[key]
    return cls(**kwargs)


# ----- types ---------------------------------------------------------------------------------------


def _split_optional(tp: TypeForm) -> tuple[TypeForm, bool]:
    """``X | None`` -> (X, True); anything else -> (tp, False)."""
    args = get_args(tp)
    if get_origin(tp) in (Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return rest[0], True
    return tp, False


def _type_name(tp: TypeForm) -> str:
    """How `tp` reads in help and errors; raises TypeError for a type this parser cannot handle."""
    base, optional = _split_optional(tp)
    name = _base_type_name(base, containers=True)
    return f"{name} | None" if optional else name


def _base_type_name(tp: TypeForm, containers: bool) -> str:
    origin, args = get_origin(tp), get_args(tp)
    if tp in (str, int, float, bool):
        return tp.__name__
    if origin is Literal and args and all(isinstance(a, str) for a in args):
        return "{" + ",".join(args) + "}"
    if containers and origin is list and dataclasses.is_dataclass(args[0]):
        return "list[table]"
    if containers and origin is list:
        return f"list[{_base_type_name(args[0], containers=False)}]"
    if containers and origin is dict and args[0] is str:
        return f"dict[str, {_base_type_name(args[1], containers=False)}]"
    raise TypeError(f"unsupported type {tp!r}")


# ----- values --------------------------------------------------------------------------------------


def _convert(option: _Option, value: TomlValue, source: str, from_cli: bool) -> OptionValue:
    """`value` (TOML data, or command-line text) as the option's type, or a ConfigError saying why."""
    try:
        if _table_type(option.type) is not None:
            return _tables(option, value, source, from_cli)
        return _coerce(value, option.type, from_cli)
    except _BadValue as e:
        detail = str(e) or f"expected {option.type_name}"
        raise ConfigError(f"Invalid value {value!r} for '{option.key}' {source}: {detail}.") from None


def _table_type(tp: TypeForm) -> type | None:
    """The dataclass of a ``list[D]`` option (a TOML array of tables), else None."""
    args = get_args(tp)
    return args[0] if get_origin(tp) is list and args and dataclasses.is_dataclass(args[0]) else None


def _tables(option: _Option, value: TomlValue, source: str, from_cli: bool) -> list[DataclassInstance]:
    """A TOML array of tables as a list of the option's dataclass, each checked like a section of its own."""
    if from_cli:
        raise _BadValue(f"set it in the TOML file, as [[{option.key}]] tables")
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise _BadValue(f"expected an array of tables, [[{option.key}]]")
    cls = _table_type(option.type)
    options = _options(cls)
    defaults = {key: entry.default for key, entry in options.items()}
    return [
        _build(cls, defaults | _from_toml(item, options, f"in [[{option.key}]] number {i + 1} {source}"))
        for i, item in enumerate(value)
    ]


def _coerce(value: TomlValue, tp: TypeForm, from_cli: bool) -> OptionValue:
    base, optional = _split_optional(tp)
    origin, args = get_origin(base), get_args(base)
    if from_cli and optional and value.strip().lower() == "none":
        none_is_a_value = base is str or (origin is Literal and "none" in args)
        if not none_is_a_value:
            return None
    if origin is Literal:
        return _choice(value, args)
    if origin is list:
        items = _split_list(value) if from_cli else value
        if not isinstance(items, list):
            raise _BadValue
        return [_coerce(item, args[0], from_cli) for item in items]
    if origin is dict:
        table = _split_pairs(value) if from_cli else value
        if not isinstance(table, dict):
            raise _BadValue
        return {name: _coerce(item, args[1], from_cli) for name, item in table.items()}
    if from_cli:
        value = _parse_scalar(value, base)
    if base is float and type(value) is int:
        return float(value)
    if type(value) is not base:  # exact: a bool is not an int, a float is not an int
        raise _BadValue
    return value


def _parse_scalar(text: str, tp: type) -> bool | int | float | str:
    if tp is bool:
        word = text.strip().lower()
        if word not in _BOOL_WORDS:
            raise _BadValue("expected bool: true/false, 1/0 or yes/no")
        return _BOOL_WORDS[word]
    try:
        return tp(text)
    except ValueError:
        raise _BadValue from None


def _choice(value: TomlValue, choices: tuple[str, ...]) -> str:
    if isinstance(value, str) and value in choices:
        return value
    same_but_case = [choice for choice in choices if choice.lower() == str(value).lower()]
    close = same_but_case or difflib.get_close_matches(str(value), choices, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise _BadValue(f"expected one of {', '.join(map(repr, choices))}{hint}")


def _split_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",")] if text.strip() else []


def _split_pairs(text: str) -> dict[str, str]:
    pairs = {}
    for item in _split_list(text):
        name, eq, value = item.partition("=")
        if not eq or not name.strip():
            raise _BadValue("expected name=value pairs separated by commas, e.g. web=0.7,code=0.3")
        pairs[name.strip()] = value.strip()
    return pairs


# ----- sources -------------------------------------------------------------------------------------


def _from_cli(argv: list[str], options: dict[str, _Option]) -> dict[str, OptionValue]:
    """Checked overrides from ``--key value`` / ``--key=value`` / bare bool flags; last one wins."""
    values = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--"):
            raise ConfigError(f"Unexpected argument {arg!r} {_CLI}; options look like --section.key VALUE.")
        key, eq, text = arg[2:].partition("=")
        if key not in options:
            raise _unknown("option", key, list(options), _CLI, dashes="--")
        option = options[key]
        if not eq:
            if i < len(argv) and not argv[i].startswith("--"):
                text, i = argv[i], i + 1
            elif _split_optional(option.type)[0] is bool:
                text = "true"
            else:
                raise ConfigError(f"Option '--{key}' {_CLI} needs a value ({option.type_name}).")
        values[key] = _convert(option, text, _CLI, from_cli=True)
    return values


def _load_toml(path: str) -> dict[str, TomlValue]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(
            f"Config file not found: {path} (looked for {os.path.abspath(path)}, given as {CONFIG_FILE_KEY})."
        ) from None
    except OSError as e:
        raise ConfigError(f"Cannot read config file {path}: {e.strerror}.") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"Invalid TOML in {path}: {e}.") from None


def _from_toml(
    table: dict[str, TomlValue], options: dict[str, _Option], source: str, prefix: str = ""
) -> dict[str, OptionValue]:
    """Flatten a TOML document into checked {dotted key: value}, rejecting names the config lacks."""
    sections = {key.rsplit(".", i)[0] for key in options for i in range(1, key.count(".") + 1)}
    values = {}
    for name, value in table.items():
        key = prefix + name
        if key in options:
            values[key] = _convert(options[key], value, source, from_cli=False)
        elif key in sections:
            if not isinstance(value, dict):
                raise ConfigError(f"'{key}' {source} is a section and must be a table, like [{key}].")
            values |= _from_toml(value, options, source, key + ".")
        elif isinstance(value, dict):
            raise _unknown("section", key, sorted(sections), source)
        else:
            raise _unknown("key", key, list(options), source)
    return values


def _unknown(kind: str, name: str, candidates: list[str], source: str, dashes: str = "") -> ConfigError:
    close = difflib.get_close_matches(name, candidates, n=1)
    hint = f"did you mean '{dashes}{close[0]}'?" if close else "run with --help to list every option."
    return ConfigError(f"Unknown {kind} '{dashes}{name}' {source}; {hint}")


# ----- TOML output ---------------------------------------------------------------------------------


def _toml_blocks(config: DataclassInstance, path: str) -> list[str]:
    """One text block per table: its own keys first (TOML requires that), then its sub-tables."""
    own, nested = [f"[{path}]"] if path else [], []
    for f in dataclasses.fields(config):
        if not f.init:
            continue
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            nested += _toml_blocks(value, f"{path}.{f.name}" if path else f.name)
        elif value and isinstance(value, list) and dataclasses.is_dataclass(value[0]):
            key = f"{path}.{f.name}" if path else f.name
            nested += ["\n".join([f"[[{key}]]", *_toml_blocks(item, "")]) for item in value]
        elif value is None:
            own.append(f"# {f.name} is None (TOML has no null)")
        else:
            own.append(f"{f.name} = {_toml_value(value)}")
    return (["\n".join(own)] if own else []) + nested


def _toml_value(value: OptionValue) -> str:
    match value:
        case bool():
            return "true" if value else "false"
        case int() | float():
            return repr(value)  # Python's float repr (1e-05, inf, nan) is valid TOML
        case str():
            return '"' + value.translate(_TOML_ESCAPES) + '"'
        case list():
            return "[" + ", ".join(map(_toml_value, value)) + "]"
        case dict():
            items = ", ".join(f"{_toml_value(str(k))} = {_toml_value(v)}" for k, v in value.items())
            return "{ " + items + " }" if items else "{}"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def _show(value: OptionValue) -> str:
    """A default as help shows it: TOML syntax, and ``none`` (the command-line word) for None."""
    return "none" if value is None else _toml_value(value)
