"""Pickles written by others, read by an interpreter of their opcodes instead of by `pickle`.

`pickle.load` resolves every global a file names to the live object (a class, a function, a module) and then calls
it, sets its attributes (BUILD) or both: a restricted `find_class` still hands the file a class it may modify. This
interpreter walks the opcodes (`pickletools.genops`) and builds only what its `Grammar` lists:

- GLOBAL and STACK_GLOBAL push the grammar's inert `Global` for that name (or, for a constant such as a dtype, the
  value); a name the grammar lacks is refused. No class, module or function is ever returned, stored or modified;
- REDUCE calls a `Global`'s own checking function on its arguments (never the object the name denotes);
- NEWOBJ makes a `_Blank` of a `Global`'s record; BUILD gives a blank its fields once, through the record's checked
  `build`; a BUILD on anything else (a `Global`, a value, a record already built) is refused;
- GET fetches only immutable scalars, the grammar's globals and the immutable types it names: a list, dict, tuple or
  record is never used twice, so the result is a tree no bigger than the file (no cycles, no sharing to multiply the
  work of whatever walks it);
- every other opcode (INST, OBJ, NEWOBJ_EX, PERSID, BINPERSID, EXT1/2/4, ...) is refused by name, and so is an
  opcode the grammar does not list.

The memo, the stack, the nesting of marks and string lengths are bounded. A refusal raises `Refused`, whose message
names the opcode, its byte position and what was refused; the caller names the file.
"""

from __future__ import annotations

import pickletools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias, TypeVar, Union

MAX_MEMO = 1 << 24  # entries; a 405B model's 1,024-rank metadata memoizes a few million objects
MAX_STACK = 1 << 16  # items between two marks; picklers write lists and dicts in batches of 1,000
MAX_MARKS = 64  # nested marks; DCP's metadata nests 5 deep
MAX_STRING = 1 << 20  # characters or bytes of one string


# An item of the interpreter's stack: a scalar, a container of items, a grammar's `Global` token or constant, a
# `_Blank`, or what a grammar's call or record built. All of it comes from the file, so every use narrows it first.
Item: TypeAlias = object
Container = TypeVar("Container", list, dict)
# An opcode's argument as `pickletools.genops` decodes it (None for an opcode without one).
Argument: TypeAlias = Union[None, int, float, str, bytes]


class Refused(Exception):
    """What the interpreter refused and where (the opcode, its byte position); the caller adds the file."""


class NotAPickle(Refused):
    """Bytes that are no pickle at all (an unknown opcode, a truncated argument, no STOP): damage, not code."""


@dataclass(frozen=True)
class Record:
    """A class a pickle may instantiate with NEWOBJ (no arguments) and give fields with one BUILD: `build` turns
    the BUILD state into the instance, checking every field, or raises Refused; `fields` says which names it
    accepts (empty: a record with no fields, made whole by NEWOBJ alone)."""

    cls: type
    build: Callable[[Item], object]
    fields: tuple[str, ...] = ()


@dataclass(frozen=True)
class Global:
    """What a pickle gets for the name `module.name`: a constant `value` (not None: an immutable value such as a
    dtype), or this token, which REDUCE may `call` (our function of the checked argument tuple) or NEWOBJ may
    instantiate as `record`. The token is all the pickle sees of the name."""

    module: str
    name: str
    value: object = None
    call: Callable[[tuple[Item, ...]], object] | None = None
    record: Record | None = None

    def __str__(self) -> str:
        return f"{self.module}.{self.name}"


@dataclass(frozen=True)
class Grammar:
    """The opcodes a kind of pickle may use, the globals it may name, and what it is called in messages."""

    what: str
    opcodes: frozenset[str]
    globals: Mapping[tuple[str, str], Global] = field(default_factory=dict)
    immutable: tuple[type, ...] = ()  # types besides scalars that a pickle may fetch from its memo more than once


class _Blank:
    """An instance NEWOBJ made of `record`, waiting for the one BUILD that gives it its fields."""

    __slots__ = ("record",)

    def __init__(self, record: Record) -> None:
        self.record = record


_SCALARS = (type(None), bool, int, float, str, bytes)

# The opcodes of protocols 2 to 5 that plain values (None, booleans, numbers, strings, bytes, lists, tuples, dicts)
# pickle to: what torch.save writes for them, and the skeleton of DCP's metadata.
PLAIN_OPCODES = frozenset({
    "PROTO", "FRAME", "STOP", "MARK", "MEMOIZE", "BINPUT", "LONG_BINPUT", "BINGET", "LONG_BINGET",
    "NONE", "NEWTRUE", "NEWFALSE", "BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT",
    "SHORT_BINUNICODE", "BINUNICODE", "SHORT_BINBYTES", "BINBYTES",
    "EMPTY_TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "TUPLE", "EMPTY_LIST", "APPEND", "APPENDS",
    "EMPTY_DICT", "SETITEM", "SETITEMS",
})  # fmt: skip
OBJECT_OPCODES = frozenset({"GLOBAL", "STACK_GLOBAL", "REDUCE", "NEWOBJ", "BUILD"})

PLAIN_VALUES = Grammar("a plain value", PLAIN_OPCODES)
# What a pickle under PLAIN_VALUES can build: its grammar names no global, so nothing but these.
PlainValue: TypeAlias = Union[
    None, bool, int, float, str, bytes, list["PlainValue"], tuple["PlainValue", ...], dict["PlainValue", "PlainValue"]
]


def interpret(data: bytes, grammar: Grammar) -> Item:
    """The object the pickle `data` describes, built as `grammar` allows (its caller checks that it is what it
    expects: the pickle may end on any item); Refused otherwise."""
    return _Machine(grammar).run(data)


class _Machine:
    def __init__(self, grammar: Grammar) -> None:
        self.grammar = grammar
        self.stack: list[Item] = []
        self.marks: list[list[Item]] = []
        self.memo: dict[int, Item] = {}
        self.where = ""

    def run(self, data: bytes) -> Item:
        for name, arg, position in _opcodes(data):
            self.where = f"{name} at byte {position}"
            if name not in self.grammar.opcodes:
                raise Refused(f"it holds the opcode {self.where}, which {self.grammar.what} never holds")
            if name == "STOP":
                if self.marks or len(self.stack) != 1:
                    raise Refused(f"its {self.where} leaves {len(self.stack)} objects, not one")
                return self.stack[0]
            _HANDLERS[name](self, arg)
        raise NotAPickle("it ends without STOP")

    def refuse(self, why: str) -> Refused:
        return Refused(f"{why} ({self.where})")

    # The stack -----------------------------------------------------------------------------------------------

    def push(self, value: Item) -> None:
        if len(self.stack) >= MAX_STACK:
            raise self.refuse(f"its stack grows past {MAX_STACK:,} items")
        self.stack.append(value)

    def pop(self) -> Item:
        if not self.stack:
            raise self.refuse("it takes from an empty stack")
        return self.stack.pop()

    def top(self, kind: type[Container]) -> Container:
        value = self.stack[-1] if self.stack else None
        if not isinstance(value, kind) or type(value) is not kind:  # exactly: no subclass a grammar's call built
            raise self.refuse(f"it needs a {kind.__name__} under it")
        return value

    def protocol(self, version: int) -> None:
        if not 2 <= version <= 5:
            raise self.refuse(f"it is written with pickle protocol {version}, not 2 to 5")

    def mark(self, _: None) -> None:
        if len(self.marks) >= MAX_MARKS:
            raise self.refuse(f"it nests more than {MAX_MARKS} marks")
        self.marks.append(self.stack)
        self.stack = []

    def pop_mark(self) -> list[Item]:
        if not self.marks:
            raise self.refuse("it has no mark to return to")
        items, self.stack = self.stack, self.marks.pop()
        return items

    # The memo ------------------------------------------------------------------------------------------------

    def put(self, index: int) -> None:
        if not self.stack:
            raise self.refuse("it memoizes an empty stack")
        if len(self.memo) >= MAX_MEMO and index not in self.memo:
            raise self.refuse(f"its memo grows past {MAX_MEMO:,} entries")
        self.memo[index] = self.stack[-1]

    def get(self, index: int) -> None:
        if index not in self.memo:
            raise self.refuse(f"it fetches the memo entry {index}, which was never stored")
        value = self.memo[index]
        if not (type(value) in _SCALARS or type(value) in self.grammar.immutable or isinstance(value, Global)):
            raise self.refuse(f"it uses one {_describe(value)} twice")
        self.push(value)

    # Values --------------------------------------------------------------------------------------------------

    def string(self, value: str | bytes) -> None:
        if len(value) > MAX_STRING:
            raise self.refuse(f"it holds a string of {len(value):,} characters; at most {MAX_STRING:,} are read")
        self.push(value)

    def tuple_of(self, count: int) -> None:
        if len(self.stack) < count:
            raise self.refuse("it takes from an empty stack")
        items = tuple(self.stack[len(self.stack) - count :]) if count else ()
        del self.stack[len(self.stack) - count :]
        self.push(items)

    def append(self, _: None) -> None:
        value = self.pop()
        self.top(list).append(value)

    def appends(self, _: None) -> None:
        items = self.pop_mark()
        self.top(list).extend(items)

    def setitem(self, _: None) -> None:
        value = self.pop()
        self.setitems([self.pop(), value])

    def setitems(self, items: list[Item]) -> None:
        target = self.top(dict)
        if len(items) % 2:
            raise self.refuse("it gives a key without a value")
        for key, value in zip(items[::2], items[1::2]):
            try:
                present = key in target
            except TypeError:  # an unhashable key
                raise self.refuse(f"it uses a {_describe(key)} as a key") from None
            if present:
                raise self.refuse(f"it gives the key {_shown(key)} twice")
            target[key] = value

    # Globals and objects -------------------------------------------------------------------------------------

    def global_named(self, module: Item, name: Item) -> None:
        if not isinstance(module, str) or not isinstance(name, str):
            raise self.refuse("it names a global with no string name")
        known = self.grammar.globals.get((module, name))
        if known is None:
            raise self.refuse(f"it names {module}.{name}, which {self.grammar.what} never holds")
        self.push(known.value if known.value is not None else known)

    def reduce(self, _: None) -> None:
        args, function = self.pop(), self.pop()
        if not isinstance(function, Global) or function.call is None:
            raise self.refuse(f"it calls {_describe(function)}, which {self.grammar.what} never calls")
        if type(args) is not tuple:
            raise self.refuse(f"it calls {function} with a {_describe(args)}")
        try:
            self.push(function.call(args))
        except Refused as error:
            raise self.refuse(f"it calls {function}{_shown(args)}: {error}") from None

    def newobj(self, _: None) -> None:
        args, cls = self.pop(), self.pop()
        if not isinstance(cls, Global) or cls.record is None:
            raise self.refuse(f"it instantiates {_describe(cls)}, which {self.grammar.what} never holds")
        if args != ():
            raise self.refuse(f"it instantiates {cls} with arguments {_shown(args)}")
        self.push(_Blank(cls.record) if cls.record.fields else cls.record.build(None))

    def build(self, _: None) -> None:
        state = self.pop()
        target = self.pop()
        if type(target) is not _Blank:
            raise self.refuse(
                f"it sets the fields of {_describe(target)}: only an object this pickle made is given fields, once"
            )
        try:
            self.push(target.record.build(state))
        except Refused as error:
            raise self.refuse(f"{target.record.cls.__name__}: {error}") from None


def _opcodes(data: bytes) -> Iterator[tuple[str, Argument, int]]:
    """`data`'s opcodes, their arguments and byte positions; Refused where it is no pickle."""
    try:
        for opcode, arg, position in pickletools.genops(data):
            yield opcode.name, arg, position
    except ValueError as error:  # an unknown opcode, a truncated argument
        raise NotAPickle(f"it is no pickle ({error})") from None


def _describe(value: Item) -> str:
    if isinstance(value, Global):
        return f"{value}, a global"
    if isinstance(value, _Blank):
        return f"{value.record.cls.__name__} object"
    return type(value).__name__


def _shown(args: Item) -> str:
    text = repr(args)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _string_pair(machine: _Machine, arg: str) -> None:
    module, _, name = arg.partition(" ")
    machine.global_named(module, name)


def _stack_global(machine: _Machine, _: None) -> None:
    name, module = machine.pop(), machine.pop()
    machine.global_named(module, name)


# What an opcode does to the machine, given its argument (whose type depends on the opcode: an int for BININT, a
# str for BINUNICODE, None for APPEND).
Handler: TypeAlias = Callable[[_Machine, Any], None]


def _build_handlers() -> dict[str, Handler]:
    constant = lambda value: lambda m, _: m.push(value)  # noqa: E731
    handlers: dict[str, Handler] = {
        "PROTO": _Machine.protocol,
        "FRAME": lambda m, _: None,
        "MARK": _Machine.mark,
        "MEMOIZE": lambda m, _: m.put(len(m.memo)),
        "BINPUT": _Machine.put,
        "LONG_BINPUT": _Machine.put,
        "BINGET": _Machine.get,
        "LONG_BINGET": _Machine.get,
        "NONE": constant(None),
        "NEWTRUE": constant(True),
        "NEWFALSE": constant(False),
        "EMPTY_TUPLE": lambda m, _: m.tuple_of(0),
        "TUPLE1": lambda m, _: m.tuple_of(1),
        "TUPLE2": lambda m, _: m.tuple_of(2),
        "TUPLE3": lambda m, _: m.tuple_of(3),
        "TUPLE": lambda m, _: m.push(tuple(m.pop_mark())),
        "EMPTY_LIST": lambda m, _: m.push([]),
        "APPEND": _Machine.append,
        "APPENDS": _Machine.appends,
        "EMPTY_DICT": lambda m, _: m.push({}),
        "SETITEM": _Machine.setitem,
        "SETITEMS": lambda m, _: m.setitems(m.pop_mark()),
        "GLOBAL": _string_pair,
        "STACK_GLOBAL": _stack_global,
        "REDUCE": _Machine.reduce,
        "NEWOBJ": _Machine.newobj,
        "BUILD": _Machine.build,
    }
    for name in ("BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT"):
        handlers[name] = _Machine.push
    for name in ("SHORT_BINUNICODE", "BINUNICODE", "SHORT_BINBYTES", "BINBYTES"):
        handlers[name] = _Machine.string
    return handlers


_HANDLERS = _build_handlers()
