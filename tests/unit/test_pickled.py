"""The pickle interpreter (torchpre/checkpoint/pickled.py) and its grammar of DCP metadata: every global it allows
is inert (a BUILD gadget against each, generated from the grammar's own table, is refused and leaves the real object
as it was), every opcode outside the grammar is refused by name, containers give plain data, and the memo, the stack,
the nesting of marks and strings are bounded."""

import importlib
import pickle
import pickletools
import struct

import pytest
import torch

from torchpre.checkpoint import pickled
from torchpre.checkpoint.metadata_pickle import GLOBALS, METADATA
from torchpre.checkpoint.pickled import PLAIN_VALUES, Refused, interpret

PROTO = b"\x80\x04"
STOP = b"."


def _str(text: str) -> bytes:
    """SHORT_BINUNICODE `text`."""
    data = text.encode()
    return b"\x8c" + bytes([len(data)]) + data


def _global(module: str, name: str, opcode: str) -> bytes:
    return _str(module) + _str(name) + b"\x93" if opcode == "STACK_GLOBAL" else f"c{module}\n{name}\n".encode()


def _program(*parts: bytes) -> bytes:
    return PROTO + b"".join(parts) + STOP


# {"pwned": True}, the state a BUILD gadget gives: pickle sets it as an attribute of whatever is under it.
STATE = b"}" + _str("pwned") + b"\x88" + b"s"
# A valid argument tuple (pickled) for every global that REDUCE may call.
CALL_ARGS = {
    ("torch", "Size"): b"K\x02K\x03\x86\x85",
    ("torch.serialization", "_get_layout"): _str("torch.strided") + b"\x85",
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): b"K\x00\x85",
    ("collections", "OrderedDict"): b")",
} | {
    (module, name): _str("tmp") + b"\x85"
    for module, name in GLOBALS
    if name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")
}


def _real(module: str, name: str) -> object | None:
    """The object `module.name` denotes in this interpreter, if it exists here (pathlib._local is Python 3.13's)."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def _attributes(target: object) -> dict[str, object]:
    """Every attribute of `target`, as getattr gives it, for comparing before and after."""
    names = set(dir(target)) | set(getattr(target, "__dict__", {}))
    values = {}
    for name in names:
        try:
            values[name] = getattr(target, name)
        except Exception as error:  # a descriptor that needs an instance
            values[name] = type(error)
    return values


def _kinds(key: tuple[str, str]) -> str:
    entry = GLOBALS[key]
    return "record" if entry.record is not None else "call" if entry.call is not None else "constant"


@pytest.mark.parametrize("opcode", ["GLOBAL", "STACK_GLOBAL"])
@pytest.mark.parametrize("key", sorted(GLOBALS), ids=lambda key: ".".join(key))
def test_a_build_gadget_against_every_allowed_global_is_refused_and_changes_nothing(key, opcode):
    """BUILD on the global itself: pickle would set `pwned` on the class, function or dtype it resolved."""
    real = _real(*key)
    before = _attributes(real)
    with pytest.raises(Refused, match=r"it sets the fields of .*: only an object this pickle made is given fields"):
        interpret(_program(_global(*key, opcode), STATE, b"b"), METADATA)
    assert _attributes(real) == before
    assert not hasattr(real, "pwned")


@pytest.mark.parametrize("key", sorted(GLOBALS), ids=lambda key: ".".join(key))
def test_what_each_allowed_global_makes_takes_no_foreign_fields(key):
    """A record takes only its own fields, once; a value made by a call or a constant takes none."""
    real = _real(*key)
    before = _attributes(real)
    kind = _kinds(key)
    made = CALL_ARGS[key] + b"R" if kind == "call" else b")\x81" if kind == "record" else b""  # NEWOBJ: a blank
    expected = "it has no field 'pwned'" if kind == "record" and GLOBALS[key].record.fields else "sets the fields of"
    if key[1] == "TensorProperties":
        expected = r"its state is \{'pwned': True\}, not \(dtype"
    with pytest.raises(Refused, match=expected):
        interpret(_program(_global(*key, "STACK_GLOBAL"), made, STATE, b"b"), METADATA)
    assert _attributes(real) == before


def test_a_record_is_given_its_fields_once():
    index = _global("torch.distributed.checkpoint.metadata", "MetadataIndex", "STACK_GLOBAL")
    fields = b"}" + _str("fqn") + _str("w") + b"s"
    assert interpret(_program(index, b")\x81", fields, b"b"), METADATA).fqn == "w"
    with pytest.raises(Refused, match="it sets the fields of MetadataIndex"):
        interpret(_program(index, b")\x81", fields, b"b", fields, b"b"), METADATA)
    with pytest.raises(Refused, match="its field 'fqn' holds a int"):
        interpret(_program(index, b")\x81", b"}" + _str("fqn") + b"K\x01s", b"b"), METADATA)


@pytest.mark.parametrize("opcode", ["GLOBAL", "STACK_GLOBAL"])
@pytest.mark.parametrize("key", [("builtins", "exec"), ("os", "system"), ("torch", "load"), ("torch", "nn"),
                                 ("torch.distributed.checkpoint.metadata", "STATE_DICT_TYPE")])  # fmt: skip
def test_a_global_outside_the_grammar_is_refused_by_name(key, opcode):
    with pytest.raises(Refused, match=rf"it names {'.'.join(key)}, which a checkpoint's metadata never holds"):
        interpret(_program(_global(*key, opcode)), METADATA)
    with pytest.raises(Refused, match=rf"it holds the opcode {opcode} at byte \d+, which a plain value never holds"):
        interpret(_program(_global(*key, opcode)), PLAIN_VALUES)


class _Runs:
    def __reduce__(self):
        return exec, ("raise SystemExit('ran')",)


def test_a_pickled_call_is_refused_before_anything_runs():
    with pytest.raises(Refused, match="it names builtins.exec"):
        interpret(pickle.dumps({"planner_data": _Runs()}), METADATA)


@pytest.mark.parametrize(
    "name, body",
    [
        ("INST", b"(ibuiltins\nexec\n"),
        ("OBJ", b"(" + _global("torch", "Size", "GLOBAL") + b"o"),
        ("NEWOBJ_EX", _global("collections", "OrderedDict", "GLOBAL") + b")}\x92"),
        ("PERSID", b"P0\n"),
        ("BINPERSID", b"K\x00Q"),
        ("EXT1", b"\x82\x01"),
        ("EXT2", b"\x83\x01\x00"),
        ("EXT4", b"\x84\x01\x00\x00\x00"),
        ("DUP", b"]2"),
        ("POP", b"K\x010"),
        ("BINFLOAT", b"G" + struct.pack(">d", 1.5)),
    ],
)
def test_opcodes_outside_the_grammar_are_refused_by_name(name, body):
    for grammar in (METADATA, PLAIN_VALUES):
        if name == "BINFLOAT" and grammar is PLAIN_VALUES:
            assert interpret(_program(body), grammar) == 1.5  # a plain value may be a float; metadata holds none
            continue
        first = name if grammar is METADATA else r"\w+"  # a plain value is refused at its first global
        with pytest.raises(Refused, match=rf"it holds the opcode {first} at byte \d+, which {grammar.what} never"):
            interpret(_program(body), grammar)


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
@pytest.mark.parametrize(
    "value",
    [{"a": [1]}, {"a": [1, 2, (3, "x")], "b": {"c": None, 7: -2**40}}, [True, False, None, 0.25, "é", b"\x00"],
     ((), (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4))],
    ids=["setitem-append", "setitems-appends", "scalars", "tuples"],
)  # fmt: skip
def test_containers_give_the_plain_data_pickle_gives(value, protocol):
    data = pickle.dumps(value, protocol=protocol)
    if b"_codecs" in data:  # protocol 2 pickles bytes as a call of _codecs.encode
        with pytest.raises(Refused, match="it holds the opcode GLOBAL"):
            interpret(data, PLAIN_VALUES)
        return
    opcodes = {opcode.name for opcode, _, _ in pickletools.genops(data)}
    assert opcodes & {"SETITEM", "SETITEMS", "APPEND", "APPENDS", "TUPLE", "BINUNICODE", "SHORT_BINUNICODE",
                      "BINFLOAT", "NEWTRUE"}  # fmt: skip
    assert interpret(data, PLAIN_VALUES) == value == pickle.loads(data)


@pytest.mark.parametrize(
    "body, why",
    [
        (_global("torch", "float32", "STACK_GLOBAL") + b")R", "it calls dtype, which a checkpoint's metadata never"),
        (_global("torch", "Size", "STACK_GLOBAL") + _str("x") + b"\x85\x85R", "a size holds 64-bit integers only"),
        (_global("torch", "Size", "STACK_GLOBAL") + b")\x81", r"it instantiates torch.Size, a global, which"),
        (_global("torch.serialization", "_get_layout", "STACK_GLOBAL") + _str("torch.sparse_coo") + b"\x85R",
         "a checkpoint's tensors are strided"),
        (_global("torch.distributed.checkpoint.metadata", "Metadata", "STACK_GLOBAL") + b"K\x01\x85\x81",
         r"it instantiates torch.distributed.checkpoint.metadata.Metadata with arguments \(1,\)"),
        (b"}" + STATE + b"b", "it sets the fields of dict"),
        (b"]\x94h\x00\x86", "it uses one list twice"),
        (b"}\x94h\x00" + b"K\x01s", "it uses one dict twice"),
        (b"}]K\x01s", "it uses a list as a key"),
        (b"}(K\x01K\x02K\x01K\x03u", "it gives the key 1 twice"),
        (b"h\x07", "it fetches the memo entry 7, which was never stored"),
        (b"K\x01K\x02", "leaves 2 objects, not one"),
        (b"a", "it takes from an empty stack"),
    ],
)  # fmt: skip
def test_misused_opcodes_are_refused(body, why):
    with pytest.raises(Refused, match=why):
        interpret(_program(body), METADATA)


def test_bytes_that_are_no_pickle_are_refused():
    for data in (b"", b"\xff\xfe", PROTO + b"K", b"garbage\x00"):
        with pytest.raises(Refused, match="it is no pickle|it holds the opcode"):
            interpret(data, METADATA)


def test_the_memo_the_stack_the_marks_and_strings_are_bounded(monkeypatch):
    monkeypatch.setattr(pickled, "MAX_MEMO", 3)
    with pytest.raises(Refused, match="its memo grows past 3 entries"):
        interpret(_program(b"]" + b"\x94K\x01a" * 4), PLAIN_VALUES)
    monkeypatch.setattr(pickled, "MAX_STACK", 8)
    with pytest.raises(Refused, match="its stack grows past 8 items"):
        interpret(pickle.dumps(list(range(20))), PLAIN_VALUES)
    nested: tuple = ()
    for _ in range(70):
        nested = (1, 2, 3, nested)  # a tuple of four or more is pickled between a MARK and TUPLE
    with pytest.raises(Refused, match="it nests more than 64 marks"):
        interpret(pickle.dumps(nested), PLAIN_VALUES)
    monkeypatch.setattr(pickled, "MAX_STRING", 10)
    with pytest.raises(Refused, match="it holds a string of 11 characters; at most 10 are read"):
        interpret(pickle.dumps("x" * 11), PLAIN_VALUES)
    assert interpret(pickle.dumps("x" * 10), PLAIN_VALUES) == "x" * 10


def test_every_call_global_has_a_sample_and_the_dtypes_are_the_fixed_table():
    calls = {key for key in GLOBALS if GLOBALS[key].call is not None}
    assert calls == set(CALL_ARGS)
    constants = {key[1]: GLOBALS[key].value for key in GLOBALS if _kinds(key) == "constant"}
    assert constants["float32"] is torch.float32 and constants["bfloat16"] is torch.bfloat16
    assert all(isinstance(value, torch.dtype) for value in constants.values())
