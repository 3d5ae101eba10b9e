"""What a case can do to one file (or folder) of its inputs, by format: each mutator changes the file in place with
a seeded `random.Random` and returns a `Mutation` saying what it did and whether the input is still valid with
another value (`may_change`: the result may then differ), or invalid (the load must refuse it, or not read it)."""

import hashlib
import json
import os
import pickle
import pickletools
import random
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata

from torchpre.checkpoint.metadata_pickle import GLOBALS as METADATA_GLOBALS


@dataclass(frozen=True)
class Mutation:
    target: str  # the file or folder, relative to the case
    what: str
    may_change: bool = False


Mutator = Callable[[Path, random.Random], tuple[str, bool]]  # (what, may_change)

_RAW = "\x00RAW\x00"  # stands for raw JSON text spliced in after dumping (numbers json.dumps cannot write, nesting)


# JSON -----------------------------------------------------------------------------------------------------------------


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (keys and indices) of a JSON value, the root's () first."""
    found = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            found += _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value[:50]):
            found += _paths(item, (*prefix, index))
    return found


def _get(value: Any, path: tuple) -> Any:
    for part in path:
        value = value[part]
    return value


def _set(root: Any, path: tuple, new: Any) -> Any:
    if not path:
        return new
    _get(root, path[:-1])[path[-1]] = new
    return root


_STRINGS = ["", "x" * 200_000, "../outside", "/etc/passwd", "a\x00b", "..", "sub/../../x", "C:\\x", "é\u202e",
            "step-2", "__0_0.distcp", "model.safetensors", "\ud800"]  # fmt: skip
_NUMBERS = [-1, -7, 2**31, 2**63, 2**64 + 1, 2**70, 10**25, -(2**63) - 1, 1e308, -1e308, 1e-320, 0.5, -0.0, 3.5]
_CONSTANTS = ["NaN", "Infinity", "-Infinity"]


def mutate_json_value(value: Any, rng: random.Random, defaults_on_delete: bool = False) -> tuple[Any, str, bool, str]:
    """A mutated copy of the parsed JSON `value`: (new value, what, may_change, raw text for _RAW)."""
    value = json.loads(json.dumps(value))
    path = rng.choice(_paths(value))
    current = _get(value, path)
    where = "/".join(map(str, path)) or "<root>"
    op = rng.choice(["delete", "type", "number", "constant", "string", "digits", "deep", "in-range", "zero",
                     "container", "key"])  # fmt: skip
    raw = ""
    may_change = False
    if op == "delete" and path:
        parent = _get(value, path[:-1])
        del parent[path[-1]]
        return value, f"deleted {where}", defaults_on_delete, raw
    if op == "in-range" and isinstance(current, (int, float)) and not isinstance(current, bool):
        new = current + rng.choice([1, 2]) if isinstance(current, int) else current * rng.choice([0.5, 1.5, 2.0])
        return _set(value, path, new), f"{where}: {current!r} -> {new!r}", True, raw
    if op == "zero" and isinstance(current, (int, float)) and not isinstance(current, bool):
        return _set(value, path, 0), f"{where}: {current!r} -> 0", True, raw
    if op == "key" and isinstance(current, dict) and current:
        key = rng.choice(list(current))
        current[rng.choice(["", "../x", key + "_", "a\x00b", "x" * 10_000])] = current.pop(key)
        return value, f"{where}: renamed key {key!r}", may_change, raw
    if op == "number":
        new = rng.choice(_NUMBERS)
    elif op == "constant":
        new, raw = _RAW, rng.choice(_CONSTANTS)
    elif op == "string":
        new = rng.choice(_STRINGS)
    elif op == "digits":
        new, raw = _RAW, rng.choice(["1", "-9"]) + "0" * rng.choice([40, 5000])
    elif op == "deep":
        depth = rng.choice([70, 1100, 100_000])
        new, raw = _RAW, "[" * depth + "]" * depth
    elif op == "container":
        new = rng.choice([[current], {"x": current}, [], {}, [current] * 3])
    else:
        new = rng.choice(["a string", 7, -7, 3.5, True, False, None, [], {}, [1, 2], {"a": 1}])
    return _set(value, path, new), f"{where}: {op} -> {raw[:20] or repr(new)[:40]}", may_change, raw


def dump_json(value: Any, raw: str) -> str:
    text = json.dumps(value, indent=1, allow_nan=True)
    return text.replace(json.dumps(_RAW), raw) if raw else text


def json_file(defaults_on_delete: bool = False, values_may_change: bool = False) -> Mutator:
    """A JSON file: a field mutated, or its text broken (truncated, another top level, not UTF-8). With
    `values_may_change` (a file of settings whose every field another valid value may take, a tokenizer's) a
    mutated field may change the result; broken text, nesting past the bound and huge integers never may."""

    def mutate(path: Path, rng: random.Random) -> tuple[str, bool]:
        text = path.read_text(encoding="utf-8")
        roll = rng.random()
        if roll < 0.1:
            broken = rng.choice([
                text[: rng.randrange(len(text) + 1)], "[]", "null", "1", '"x"', "\ufeff" + text, text + "}",
                '{"a": 1, "a": [1]}', text.replace("{", '{"dup": 1, "dup": 2, ', 1),
            ])  # fmt: skip
            path.write_text(broken, encoding="utf-8")
            return f"text replaced ({len(broken)} chars)", False
        if roll < 0.13:
            path.write_bytes(path.read_bytes() + b"\xff\xfe")
            return "not UTF-8", False
        value, what, may_change, raw = mutate_json_value(json.loads(text), rng, defaults_on_delete)
        path.write_text(dump_json(value, raw), encoding="utf-8")
        return what, may_change or (values_may_change and not raw)

    return mutate


def json_lines(may_change_values: bool) -> Mutator:
    """A JSON Lines file: one line's record mutated, or lines deleted, duplicated, broken."""

    def mutate(path: Path, rng: random.Random) -> tuple[str, bool]:
        lines = path.read_bytes().splitlines(keepends=True)
        if not lines:
            path.write_bytes(b"{}\n")
            return "a line added to an empty file", False
        index = rng.randrange(len(lines))
        op = rng.choice(["record", "record", "record", "broken", "delete", "huge", "empty-all"])
        if op == "record":
            try:
                value, what, may_change, raw = mutate_json_value(json.loads(lines[index]), rng)
            except ValueError:
                return "an unparsable line left as it was", True
            lines[index] = dump_json(value, raw).replace("\n", " ").encode() + b"\n"
            return f"line {index + 1}: {what}", may_change or may_change_values
        if op == "broken":
            lines[index] = lines[index][: len(lines[index]) // 2] + b"\n"
        elif op == "delete":
            del lines[index]
            path.write_bytes(b"".join(lines))
            return f"line {index + 1} deleted", True
        elif op == "huge":
            lines[index] = b'{"context": "' + b"x" * 20_000_000 + b'"}\n'
        else:
            lines = [b"\n"]
        path.write_bytes(b"".join(lines))
        return f"line {index + 1}: {op}", False

    return mutate


# Pickle: DCP's .metadata ----------------------------------------------------------------------------------------------

# Globals a gadget names: every global the metadata interpreter allows (its own table, so a new one is fuzzed too),
# and what a payload reaches for.
PAYLOAD_GLOBALS = [
    ("builtins", "exec"), ("builtins", "eval"), ("builtins", "getattr"), ("builtins", "setattr"), ("os", "system"),
    ("posix", "system"), ("torchpre.confined.read", "open_beneath"), ("torchpre.checkpoint.reader", "read_metadata"),
    ("builtins", "dict"), ("copyreg", "_reconstructor"), ("torch._utils", "_rebuild_tensor_v2"),
    ("functools", "partial"), ("collections", "OrderedDict"),
]  # fmt: skip
GADGET_GLOBALS = sorted(METADATA_GLOBALS) + PAYLOAD_GLOBALS
_ATTRIBUTES = ["__eq__", "__init__", "__new__", "__setstate__", "__reduce_ex__", "__getattr__", "_fields", "value",
               "is_relative_to", "resolve", "__class__", "__dict__", "planner_data", "chunks"]  # fmt: skip


def _unicode(text: str) -> bytes:
    data = text.encode("utf-8", "surrogatepass")
    return b"X" + struct.pack("<I", len(data)) + data


def _global(module: str, name: str) -> bytes:
    return _unicode(module) + _unicode(name) + b"\x93"  # STACK_GLOBAL


def gadget(rng: random.Random, outside: Path) -> tuple[bytes, str]:
    """A pickle program that leaves one object on the stack (popped by the caller): a global used as the target of
    BUILD, REDUCE, NEWOBJ, INST, OBJ, SETITEM, an extension code or a persistent id."""
    module, name = rng.choice(GADGET_GLOBALS)
    target = _global(module, name)
    kind = rng.choice(["BUILD", "BUILD-slots", "REDUCE", "REDUCE-payload", "NEWOBJ", "INST", "OBJ", "SETITEM",
                       "EXT", "PERSID", "GLOBAL-text", "APPEND"])  # fmt: skip
    attribute = rng.choice(_ATTRIBUTES)
    other = _global(*rng.choice(GADGET_GLOBALS))
    if kind == "BUILD":  # target.__dict__.update({attribute: other global}) or target.__setstate__(...)
        program = target + b"}" + _unicode(attribute) + other + b"s" + b"b"
    elif kind == "BUILD-slots":  # (None, {attribute: 1}): setattr on the target
        program = target + b"N}" + _unicode(attribute) + b"K\x01s" + b"\x86" + b"b"
    elif kind == "REDUCE":
        argument = rng.choice([b")", _unicode("x" * 100) + b"\x85", b"\x8a\x09" + b"\xff" * 9 + b"\x85",
                               b"J\xff\xff\xff\xff\x85", other + b"\x85"])  # fmt: skip
        program = target + argument + b"R"
    elif kind == "REDUCE-payload":
        code = f"open({str(outside / 'payload-ran')!r}, 'a').write('ran')"
        program = _global("builtins", "exec") + _unicode(code) + b"\x85R"
    elif kind == "NEWOBJ":
        program = target + b")" + b"\x81"
    elif kind == "INST":
        program = b"(" + f"i{module}\n{name}\n".encode()
    elif kind == "OBJ":
        program = b"(" + target + b"o"
    elif kind == "SETITEM":
        program = target + _unicode(attribute) + other + b"s"
    elif kind == "EXT":
        program = b"\x82" + bytes([rng.randrange(1, 256)])
    elif kind == "PERSID":
        program = b"P" + rng.choice([b"0", b"storage"]) + b"\n"
    elif kind == "GLOBAL-text":
        program = f"c{module}\n{name}\n".encode()
    else:
        program = b"]" + target + b"a"
    return program, f"{kind} on {module}.{name}" + (f" ({attribute})" if "BUILD" in kind or kind == "SETITEM" else "")


def _genuine_body(data: bytes) -> bytes:
    """The program of a protocol-2+ pickle without its PROTO opcode (FRAME and the rest kept)."""
    return data[2:] if data[:1] == b"\x80" else data


def _metadata_edit(metadata: Any, rng: random.Random) -> tuple[str, bool]:
    """A semantic change to a decoded DCP Metadata (the case's own genuine file, decoded in the fuzzer's process)."""
    tensors = [(key, value) for key, value in metadata.state_dict_metadata.items()
               if isinstance(value, TensorStorageMetadata)]  # fmt: skip
    key, entry = rng.choice(tensors)
    storage = list(metadata.storage_data.items())
    op = rng.choice(["no-chunks", "gap", "overlap", "chunk-offset", "chunk-size", "size", "dtype", "bytes-entry",
                     "offset", "length", "path", "drop-storage", "drop-entry", "storage-type"])  # fmt: skip
    if op == "no-chunks":
        entry.chunks = []
    elif op == "gap" and entry.chunks and entry.size and entry.size[0] > 1:
        chunk = entry.chunks[0]
        entry.chunks[0] = ChunkStorageMetadata(chunk.offsets, torch.Size([chunk.sizes[0] - 1, *chunk.sizes[1:]]))
    elif op == "overlap" and entry.chunks:
        entry.chunks.append(entry.chunks[0])
    elif op == "chunk-offset" and entry.chunks:
        chunk = entry.chunks[0]
        entry.chunks[0] = ChunkStorageMetadata(torch.Size([rng.choice([-1, 1, 10**9])] * len(chunk.offsets)),
                                               chunk.sizes)  # fmt: skip
    elif op == "chunk-size" and entry.chunks:
        chunk = entry.chunks[0]
        sizes = torch.Size([rng.choice([-1, 0, 2**40])] * len(chunk.sizes))
        entry.chunks[0] = ChunkStorageMetadata(chunk.offsets, sizes)
    elif op == "size":
        entry.size = torch.Size([rng.choice([0, 2**40, 3])] * max(1, len(entry.size)))
    elif op == "dtype":
        entry.properties.dtype = rng.choice([torch.float64, torch.int64, torch.uint8, torch.bool, torch.complex64,
                                             torch.float8_e4m3fn])  # fmt: skip
    elif op == "bytes-entry":
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        metadata.state_dict_metadata[key] = BytesStorageMetadata()
    elif op in ("offset", "length", "path", "storage-type"):
        index, info = rng.choice(storage)
        if op == "offset":
            info.offset = rng.choice([-1, 2**40, info.offset + 1, 10**7])
        elif op == "length":
            info.length = rng.choice([-1, 0, 2**40, info.length + 1, info.length * 2])
        elif op == "path":
            info.relative_path = rng.choice(["../other/__0_0.distcp", "/etc/passwd", "sub/__0_0.distcp",
                                             "state.json", "manifest.json", "", "x\x00", "link.distcp"])  # fmt: skip
        else:
            metadata.storage_data[index] = rng.choice([None, 7, "x", (1, 2)])
    elif op == "drop-storage" and storage:
        del metadata.storage_data[rng.choice(storage)[0]]
    elif op == "drop-entry":
        del metadata.state_dict_metadata[key]
    return f"{op} of {key}", False


def dcp_metadata(outside: Path, genuine: set[str]) -> Mutator:
    """DCP's pickled `.metadata`: a gadget program in front of the genuine one, a semantic edit of its records,
    or its bytes broken. Only a file whose digest is in `genuine` (a genuine input's, unaltered) is unpickled here:
    an altered one could hold a gadget, which would run in the fuzzer."""

    def mutate(path: Path, rng: random.Random) -> tuple[str, bool]:
        data = path.read_bytes()
        roll = rng.random()
        if roll < 0.45:
            program, what = gadget(rng, outside)
            path.write_bytes(b"\x80\x04" + program + b"0" + _genuine_body(data))
            return f"gadget {what}", False
        if roll < 0.85 and hashlib.sha256(data).hexdigest() in genuine:
            metadata = pickle.loads(data)  # a genuine file, unaltered
            what, may_change = _metadata_edit(metadata, rng)
            path.write_bytes(pickle.dumps(metadata))
            return what, may_change
        ops = list(pickletools.genops(data))
        op = rng.choice(["truncate", "flip", "drop-op", "stop-early"])
        if op == "truncate":
            data = data[: rng.randrange(len(data))]
        elif op == "flip":
            data = bytearray(data)
            for _ in range(rng.randrange(1, 4)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif op == "drop-op":
            index = rng.randrange(1, len(ops) - 1)
            start, end = ops[index][2], ops[index + 1][2]
            data = data[:start] + data[end:]
        else:
            data = data[: ops[rng.randrange(1, len(ops))][2]] + b"."
        path.write_bytes(bytes(data))
        return f"bytes: {op}", False

    return mutate


# Safetensors ----------------------------------------------------------------------------------------------------------


def safetensors_file(path: Path, rng: random.Random) -> tuple[str, bool]:
    """A safetensors file: its header's JSON mutated (offsets, dtypes, shapes, names), its length field, or its data."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header, body = json.loads(data[8 : 8 + length]), data[8 + length :]
    roll = rng.random()
    if roll < 0.6:
        value, what, _, raw = mutate_json_value(header, rng)
        text = dump_json(value, raw).encode()
        path.write_bytes(struct.pack("<Q", len(text)) + text + body)
        return f"header {what}", False
    if roll < 0.75:
        new = rng.choice([0, 1, len(data), 2**63, length - 1, length + 8])
        path.write_bytes(struct.pack("<Q", new) + data[8:])
        return f"header length {length} -> {new}", False
    if roll < 0.85:
        cut = rng.randrange(len(data))
        path.write_bytes(data[:cut])
        return f"truncated to {cut} bytes", False
    flipped = bytearray(data)
    position = 8 + length + rng.randrange(max(1, len(body)))
    flipped[min(position, len(flipped) - 1)] ^= 0x01
    path.write_bytes(bytes(flipped))
    return "one data bit flipped", True


def snapshot_file(path: Path, rng: random.Random) -> tuple[str, bool]:
    """An in-memory snapshot (torchpre/checkpoint/snapshots/file_format.py): its header's JSON mutated (the run,
    step, rank, layout, the tensors' offsets and sizes, the values) with the CRC-32 recomputed, as whoever can write
    /dev/shm could; or its length field, or its bytes (the CRC no longer matches). A snapshot refused falls back to the
    disk checkpoint, which gives the same result; a value changed within its range and signed anew may change it."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[8:16])
    header, body = json.loads(data[16 : 16 + length]), data[16 + length : -4]
    roll = rng.random()
    if roll < 0.6:
        value, what, may_change, raw = mutate_json_value(header, rng)
        text = dump_json(value, raw).encode()
        signed = data[:8] + struct.pack("<Q", len(text)) + text + body
        path.write_bytes(signed + struct.pack("<I", zlib.crc32(signed)))
        return f"header {what}, CRC-32 recomputed", may_change or what.startswith("values")
    if roll < 0.75:
        new = rng.choice([0, 1, len(data), 2**63, length - 1, length + 8])
        path.write_bytes(data[:8] + struct.pack("<Q", new) + data[16:])
        return f"header length {length} -> {new}", False
    return binary(may_change=False)(path, rng)


# Other files ----------------------------------------------------------------------------------------------------------


def binary(may_change: bool) -> Mutator:
    """Raw bytes (a DCP data file, a shard's offsets): truncated, extended, or bits flipped (which may change values
    within their range: `may_change`)."""

    def mutate(path: Path, rng: random.Random) -> tuple[str, bool]:
        data = bytearray(path.read_bytes())
        op = rng.choice(["truncate", "extend", "flip", "flip"])
        if op == "truncate" or not data:
            path.write_bytes(bytes(data[: rng.randrange(len(data) + 1)]))
            return "truncated", False
        if op == "extend":
            path.write_bytes(bytes(data) + b"\x00" * rng.choice([1, 8, 4096]))
            return "extended", False
        for _ in range(rng.randrange(1, 4)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
        return "bits flipped", may_change

    return mutate


def shard_tokens(vocab_size: int) -> Mutator:
    """A shard's uint16 tokens: one replaced by an id past the vocabulary (refused), or by another inside it."""

    def mutate(path: Path, rng: random.Random) -> tuple[str, bool]:
        data = bytearray(path.read_bytes())
        if len(data) < 2 or rng.random() < 0.2:
            return binary(True)(path, rng)
        index = rng.randrange(len(data) // 2)
        inside = rng.random() < 0.4
        token = rng.randrange(vocab_size) if inside else rng.randrange(vocab_size, 2**16)
        data[2 * index : 2 * index + 2] = struct.pack("<H", token)
        path.write_bytes(bytes(data))
        return f"token {index} -> {token}", inside

    return mutate


def tokenizer_file(path: Path, rng: random.Random) -> tuple[str, bool]:
    """A tiktoken file: a line's token or rank broken, lines deleted or duplicated, or another valid token."""
    lines = path.read_bytes().splitlines(keepends=True)
    index = rng.randrange(len(lines))
    op = rng.choice(["rank", "base64", "delete", "duplicate", "swap-token", "extra-field", "huge-line", "empty"])
    token, rank = lines[index].split()
    if op == "rank":
        lines[index] = token + b" " + rng.choice([b"-1", b"99999999999", b"x", b"1" * 5000, b"1.5"]) + b"\n"
    elif op == "base64":
        lines[index] = rng.choice([b"!!!", b"", b"QQ", b"A" * 10_000]) + b" " + rank + b"\n"
    elif op == "delete":
        del lines[index]
    elif op == "duplicate":
        lines.insert(index, lines[index])
    elif op == "swap-token":
        import base64

        lines[index] = base64.b64encode(os.urandom(rng.randrange(2, 6))) + b" " + rank + b"\n"
        path.write_bytes(b"".join(lines))
        return f"line {index + 1}: another token", True
    elif op == "extra-field":
        lines[index] = lines[index].rstrip(b"\n") + b" 3\n"
    elif op == "huge-line":
        lines[index] = b"A" * 30_000_000 + b" 1\n"
    else:
        lines = []
    path.write_bytes(b"".join(lines))
    return f"line {index + 1}: {op}", False


def text_file(path: Path, rng: random.Random) -> tuple[str, bool]:
    """Any text is valid input to prepare: bytes replaced, which changes the tokens."""
    data = bytearray(path.read_bytes())
    for _ in range(rng.randrange(1, 5)):
        data[rng.randrange(len(data))] = rng.randrange(256)
    path.write_bytes(bytes(data))
    return "bytes replaced", True


# The file system ------------------------------------------------------------------------------------------------------


def replace_entry(
    path: Path, rng: random.Random, decoy: Path | None, victim: Path, named: bool = False
) -> tuple[str, bool]:
    """`path` (a file or folder, present or not) replaced by a symbolic link out of the case (to the same file of
    another genuine input, `decoy`, or to the victim file, or dangling), a FIFO, a folder, or nothing. A file the
    command `named` gets no link out (the user's choice, followed)."""
    options = ["dangling", "fifo", "folder", "remove"]
    options += [] if named else ["link-victim"] + (["link-decoy"] * 3 if decoy else [])
    op = rng.choice(options)
    if path.is_symlink() or path.is_file() or path.is_fifo():
        path.unlink()
    elif path.is_dir():
        import shutil

        shutil.rmtree(path)
    if op == "link-decoy":
        os.symlink(decoy, path)
    elif op == "link-victim":
        os.symlink(victim, path)
    elif op == "dangling":
        os.symlink(path.parent / "does-not-exist", path)
    elif op == "fifo":
        os.mkfifo(path)
    elif op == "folder":
        path.mkdir()
    return op, False
