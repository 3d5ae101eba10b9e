"""A checkpoint's DCP metadata read without unpickling and checked for meaning before use (docs/security.md), and its
data read as DCP writes it and nothing else, without a training job:

- a torchpre save writes `metadata.json`, equal field for field to its pickled `.metadata`, and loads read it;
- a pickled `.metadata` alone (the committed checkpoint of main at 0a62600, a fresh sharded save) reads through the
  interpreter field for field as DCP's own `pickle.load` reads it;
- chunks that leave a gap, overlap, are missing or lie outside their file, and their siblings, are refused by name;
- data files are opened inside the folder (never through a link), and a tensor's bytes must be an archive of stored
  records, as DCP writes them;
- non-tensor entries of older checkpoints decode as plain values without torch.load, within a bound.
"""

import copy
import dataclasses
import io
import json
import math
import os
import pickle
import re
import shutil
import zipfile
from pathlib import Path, PurePath

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.tensor import Shard, distribute_tensor

import torchpre.checkpoint.manager as manager
from tests.hostile import (
    Payload,
    legacy_checkpoint,
    legacy_format,
    remove_file,
    replace_entry_bytes,
    replace_metadata,
    replace_metadata_json,
    rewrite_manifest,
)
from tests.launch import spawn
from tests.unit.test_checkpoint_integrity import _loaded_step, _manager, _save
from torchpre.checkpoint.integrity import MANIFEST, FileCheck, Trust
from torchpre.checkpoint.metadata_checks import MAX_BYTES_ENTRY, check_metadata
from torchpre.checkpoint.metadata_json import METADATA_JSON, decode
from torchpre.checkpoint.metadata_pickle import read_pickled_metadata
from torchpre.checkpoint.pickled import Refused
from torchpre.checkpoint.reader import SafeReader, read_metadata
from torchpre.checkpoint.storage import RecordingWriter
from torchpre.checkpoint.torch_save import MAX_PLAIN_VALUE, NotAnArchive, read_plain_value
from torchpre.errors import TorchpreError, UntrustedInput

REPO = Path(__file__).resolve().parents[2]
OLD_CHECKPOINT = REPO / "tests" / "fixtures" / "checkpoint_0a62600" / "step-2"


@pytest.fixture
def saved(world, tmp_path) -> Path:
    """A genuine checkpoint of the toy components at step 2 (tests/unit/test_checkpoint_integrity.py)."""
    _save(tmp_path / "checkpoint", 2)
    return tmp_path / "checkpoint" / "step-2"


def _save_sharded(mesh) -> None:
    """Rank r's halves of two tensors sharded on either dimension, with RecordingWriter, as a torchpre save."""
    folder = Path(os.environ["SHARDED_FOLDER"])
    state = {
        "model": {
            "rows": distribute_tensor(torch.arange(40.0).reshape(10, 4), mesh, [Shard(0)]),
            "columns": distribute_tensor(torch.arange(24, dtype=torch.bfloat16).reshape(2, 12), mesh, [Shard(1)]),
            "odd": distribute_tensor(torch.arange(7), mesh, [Shard(0)]),
        }
    }
    dcp.save(state, storage_writer=RecordingWriter(folder, crc=True))
    dist.barrier()


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """A checkpoint of tensors sharded over two processes: several chunks per tensor."""
    folder = tmp_path_factory.mktemp("sharded") / "step-1"
    os.environ["SHARDED_FOLDER"] = str(folder)
    try:
        spawn(_save_sharded, 2, folder.parent / "store")
    finally:
        del os.environ["SHARDED_FOLDER"]
    return folder


def _fields(value: object) -> object:
    """`value` field for field: every dataclass as its type and all its fields (those equality skips too), sizes and
    tuples with their type, paths as strings, mappings as their ordered items."""
    if dataclasses.is_dataclass(value):
        return type(value).__name__, {f.name: _fields(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return [(_fields(key), _fields(item)) for key, item in value.items()]
    if isinstance(value, (list, tuple)):
        return type(value).__name__, [_fields(item) for item in value]
    if isinstance(value, PurePath):
        return str(value)
    return value


# Reading metadata ---------------------------------------------------------------------------------------------------


def test_the_fixture_of_main_at_0a62600_reads_through_the_interpreter_as_pickle_reads_it():
    data = (OLD_CHECKPOINT / ".metadata").read_bytes()
    interpreted = read_pickled_metadata(data, OLD_CHECKPOINT / ".metadata")
    assert _fields(interpreted) == _fields(pickle.loads(data))
    assert len(interpreted.state_dict_metadata) == len(interpreted.planner_data) == 101
    assert sum(isinstance(e, BytesStorageMetadata) for e in interpreted.state_dict_metadata.values()) == 16


@pytest.mark.parametrize("checkpoint", ["one process", "sharded"])
def test_a_save_writes_metadata_json_equal_to_its_pickled_metadata_field_for_field(request, checkpoint):
    step_dir = request.getfixturevalue("saved" if checkpoint == "one process" else "sharded")
    data = (step_dir / ".metadata").read_bytes()
    pickled = read_pickled_metadata(data, step_dir / ".metadata")
    from_json = decode((step_dir / METADATA_JSON).read_bytes(), step_dir / METADATA_JSON)
    assert _fields(pickled) == _fields(pickle.loads(data)) == _fields(from_json)
    if checkpoint == "sharded":
        entries = from_json.state_dict_metadata
        assert [len(entries[f"model.{name}"].chunks) for name in ("rows", "columns", "odd")] == [2, 2, 2]
        assert entries["model.columns"].chunks[1].offsets == torch.Size([0, 6])


def test_a_save_lists_metadata_json_in_its_manifest_and_loads_read_it_never_the_pickle(saved, tmp_path):
    """`.metadata` replaced by a payload (manifest recomputed) is never read while metadata.json is listed."""
    assert METADATA_JSON in json.loads((saved / MANIFEST).read_text())["files"]
    marker = tmp_path / "marker"
    (saved / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    rewrite_manifest(saved)
    assert _loaded_step(_manager(saved.parent), saved) == 2
    assert not marker.exists()
    remove_file(saved, METADATA_JSON)  # now the folder's metadata is the pickle alone
    with pytest.raises(UntrustedInput, match=r"\.metadata: refused to load this checkpoint's metadata \(it names "
                                             r"builtins\.exec.*checkpoint\.allow_pickle = true reads it"):  # fmt: skip
        _manager(saved.parent).load(saved)
    assert not marker.exists()


def test_an_async_process_save_writes_metadata_json_too(world, tmp_path):
    checkpoints = _manager(tmp_path, async_mode="async_process")
    checkpoints.components["train"].values["step"] = 2
    checkpoints.save(2)
    checkpoints.close()
    manifest = json.loads((tmp_path / "step-2" / MANIFEST).read_text())["files"]
    assert {METADATA_JSON, ".metadata"} <= set(manifest)
    assert read_metadata(tmp_path / "step-2", FileCheck(tmp_path / "step-2")).storage_meta.save_id is not None


def test_allow_pickle_reads_a_metadata_the_interpreter_refuses_with_a_warning(saved, caplog):
    """A set, which no DCP metadata holds, needs full pickle; the checks then apply to what it gives."""
    replace_metadata(saved, lambda metadata: setattr(metadata, "version", {"1.0.0"}))
    rewrite_manifest(saved)
    with pytest.raises(UntrustedInput, match="it holds the opcode EMPTY_SET"):
        read_metadata(saved, FileCheck(saved))
    with pytest.raises(UntrustedInput, match="its version is a set, not a string"):
        read_metadata(saved, FileCheck(saved), allow_pickle=True)
    assert f"checkpoint.allow_pickle = true: unpickling {saved / '.metadata'} with full pickle" in caplog.text


# What the metadata means ----------------------------------------------------------------------------------------


@pytest.fixture
def genuine(saved):
    """The saved metadata, the file it was read from, and the sizes of the folder's files."""
    metadata = read_metadata(saved, FileCheck(saved))
    sizes = {path.name: path.stat().st_size for path in saved.iterdir()}
    return metadata, saved / METADATA_JSON, lambda name, entry: sizes[name]


def _refusal(genuine, edit) -> str:
    metadata, source, sizes = genuine
    edited = copy.deepcopy(metadata)
    edit(edited)
    with pytest.raises(UntrustedInput) as error:
        check_metadata(edited, source, sizes)
    assert str(error.value).startswith(f"{source}: ")
    return str(error.value)


def _weight(metadata):
    return metadata.state_dict_metadata["model.weight"]


def _record(metadata, fqn="model.weight", offsets=(0, 0)):
    return metadata.storage_data[MetadataIndex(fqn, offsets)]


def _add_chunk(metadata, offsets, sizes):
    """A second chunk of model.weight (4 x 4), stored where the first is."""
    _weight(metadata).chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
    metadata.storage_data[MetadataIndex("model.weight", offsets)] = copy.copy(_record(metadata))


def _resize_first(metadata, sizes):
    _weight(metadata).chunks[0].sizes = torch.Size(sizes)


CHUNKS = {
    "none": (lambda m: _weight(m).chunks.clear(), r"has the shape \(4, 4\) but no chunks: none of its elements"),
    "gap": (lambda m: _resize_first(m, (3, 4)), r"has chunks of 12 elements in all, for a shape \(4, 4\) of 16: a gap"),
    "overlap": (lambda m: _add_chunk(m, (2, 0), (2, 4)), "has chunks of 24 elements in all, for a shape"),
    "gap-and-overlap": (lambda m: (_resize_first(m, (2, 4)), _add_chunk(m, (1, 0), (2, 4))),
                        r"has chunks that leave a gap in its shape \(4, 4\) and overlap elsewhere"),
    "outside-the-shape": (lambda m: _add_chunk(m, (4, 0), (1, 4)), r"has a chunk at \(4, 0\) of size \(1, 4\) outside"),
    "negative-offset": (lambda m: _add_chunk(m, (-1, 0), (1, 4)), r"not 2 natural numbers each"),
    "wrong-rank": (lambda m: setattr(_weight(m).chunks[0], "sizes", torch.Size([16])), "not 2 natural numbers each"),
    "no-storage-record": (lambda m: m.storage_data.pop(MetadataIndex("model.weight", (0, 0))),
                          r"has no storage record for its chunk at \(0, 0\)"),
    "record-too-short": (lambda m: setattr(_record(m), "length", 63), "in 63 bytes; it needs 64"),
    "outside-the-file": (lambda m: setattr(_record(m), "offset", 10**6), r"lies at bytes 1,000,000 to .* of __0_0"),
    "unknown-dtype": (lambda m: setattr(_weight(m).properties, "dtype", torch.qint8), "not those of a dense tensor"),
    "numel-overflow": (lambda m: setattr(_weight(m), "size", torch.Size([2**40, 2**40])), "more than the"),
    "negative-size": (lambda m: setattr(_weight(m), "size", torch.Size([-4, -4])), "not at most 32 dimensions"),
    "too-many-dimensions": (lambda m: setattr(_weight(m), "size", torch.Size([1] * 33)), "not at most 32 dim"),
    "bytes-entry-too-large": (
        lambda m: (m.state_dict_metadata.__setitem__("train.blob", BytesStorageMetadata()),
                   m.storage_data.__setitem__(MetadataIndex("train.blob"), _StorageInfo("__0_0.distcp", 0, 0))),
        None),  # the length is set by the test, below the file's size
    "path-with-a-folder": (lambda m: setattr(_record(m), "relative_path", "sub/__0_0.distcp"), "not a bare file name"),
    "path-climbing-out": (lambda m: setattr(_record(m), "relative_path", ".."), "climbs out of the folder"),
    "absolute-path": (lambda m: setattr(_record(m), "relative_path", "/etc/passwd"), "is an absolute path"),
    "transforms": (lambda m: setattr(_record(m), "transform_descriptors", ["zstd"]), "through transforms"),
    "index-of-another-type": (lambda m: m.storage_data.__setitem__("x", _record(m)), "holds a str as a key"),
    "entry-of-another-type": (lambda m: m.state_dict_metadata.__setitem__("model.x", 1), "is a int, not tensor"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CHUNKS))
def test_metadata_that_means_what_dcp_never_writes_is_refused_by_name(genuine, case):
    edit, expected = CHUNKS[case]
    if case == "bytes-entry-too-large":
        metadata, source, _ = genuine
        edited = copy.deepcopy(metadata)
        edit(edited)
        edited.storage_data[MetadataIndex("train.blob")].length = MAX_BYTES_ENTRY + 1
        with pytest.raises(UntrustedInput, match=f"'train.blob' holds {MAX_BYTES_ENTRY + 1:,} bytes"):
            check_metadata(edited, source, lambda name, entry: 1 << 40)
        return
    message = _refusal(genuine, edit)
    assert re.search(expected, message), message
    if case not in ("index-of-another-type", "entry-of-another-type"):
        assert "model.weight" in message


def test_the_genuine_metadata_passes_and_a_tiling_of_many_chunks_too(genuine):
    metadata, source, sizes = genuine
    assert check_metadata(metadata, source, sizes) is metadata
    tiled = copy.deepcopy(metadata)
    _resize_first(tiled, (1, 2))
    for offsets in [(0, 2), (1, 0), (1, 2), (2, 0), (3, 0)]:
        _add_chunk(tiled, offsets, (1, 2) if offsets[0] < 2 else (1, 4))
    assert check_metadata(tiled, source, sizes) is tiled


def test_a_chunk_gap_in_metadata_json_is_refused_by_the_load_instead_of_loading_garbage(saved):
    """Before these checks an entry without chunks loaded "successfully", its tensor left as it was allocated."""

    def drop_chunks(record):
        record["state_dict_metadata"]["model.weight"]["chunks"] = []

    replace_metadata_json(saved, drop_chunks)
    rewrite_manifest(saved)
    with pytest.raises(UntrustedInput, match=rf"{saved / METADATA_JSON}: refused .*'model.weight' has the shape"):
        _manager(saved.parent).load(saved)


def test_a_chunk_gap_in_a_pickled_metadata_is_refused_too(saved):
    replace_metadata(saved, lambda metadata: _weight(metadata).chunks.clear())
    rewrite_manifest(saved)
    with pytest.raises(UntrustedInput, match=r"\.metadata: refused .*'model.weight' has the shape \(4, 4\) but no"):
        _manager(saved.parent).load(saved)


@pytest.mark.parametrize(
    "edit, why",
    [
        (lambda r: r.pop("storage_data"), "'storage_data' is missing"),
        (lambda r: r["state_dict_metadata"]["model.weight"].update(dtype="float128"), "dtype 'float128'"),
        (lambda r: r["state_dict_metadata"]["model.weight"].update(size=[4, "4"]), r"size' is not a list of at most"),
        (lambda r: r["state_dict_metadata"]["model.weight"].update(type="code"), "'tensor' or 'bytes'"),
        (lambda r: r["storage_data"].append(r["storage_data"][0]), "a second time"),
        (lambda r: r["storage_data"][0].update(offset=True), r"storage_data\[0\].offset' is true, not an integer"),
    ],
)
def test_a_metadata_json_field_of_the_wrong_type_is_refused_by_name(saved, edit, why):
    replace_metadata_json(saved, edit)
    rewrite_manifest(saved)
    with pytest.raises(UntrustedInput, match=why):
        read_metadata(saved, FileCheck(saved))


def test_an_entry_saved_as_a_tensor_where_the_load_asks_for_a_plain_value_is_named(saved):
    """DCP would fail deep inside its planner (a plain value has no chunks); the other way round the entry's bytes
    would replace a tensor of the model with whatever they decode to."""
    legacy_checkpoint(saved, "train.step", 2)

    def step_as_a_tensor(metadata):
        index = next(index for index in metadata.storage_data if index.fqn == "train.step")
        properties = TensorProperties(dtype=torch.float32)
        metadata.state_dict_metadata["train.step"] = TensorStorageMetadata(
            properties, torch.Size([]), [ChunkStorageMetadata(torch.Size([]), torch.Size([]))]
        )
        metadata.storage_data[MetadataIndex("train.step", torch.Size([]))] = metadata.storage_data.pop(index)

    replace_metadata(saved, step_as_a_tensor)
    rewrite_manifest(saved)
    with pytest.raises(TorchpreError, match=r"train.step: checkpoint a tensor of shape \(\) vs model a plain value"):
        _manager(saved.parent).load(saved)


# Reading data ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("manifest", ["with", "without"])
def test_a_storage_file_that_links_out_of_the_folder_is_never_read(saved, tmp_path, manifest):
    outside = tmp_path / "outside.distcp"
    shutil.move(saved / "__0_0.distcp", outside)
    os.symlink(outside, saved / "__0_0.distcp")
    checkpoints = _manager(saved.parent)
    if manifest == "without":
        (saved / MANIFEST).unlink()
        checkpoints.trust = Trust(allow_unverified=True)
        expected = rf"{saved / '__0_0.distcp'} \(named by {saved / METADATA_JSON}, .*relative_path\) is, or leads"
    else:
        expected = f"is corrupt: {saved / '__0_0.distcp'} is a symbolic link, not a saved file"
    with pytest.raises(TorchpreError, match=expected):
        checkpoints.load(saved)


@pytest.mark.parametrize("swapped", ["before DCP reads the metadata", "after"])
def test_a_data_file_swapped_for_a_link_after_the_checks_is_never_read(saved, tmp_path, monkeypatch, swapped):
    """The folder was checked whole and its metadata read; then the data file becomes a link out of it. The read of
    the data opens the file inside the folder without following a link, and refuses it."""
    outside = tmp_path / "outside.distcp"
    shutil.copy(saved / "__0_0.distcp", outside)
    owner, name = (manager, "checkpoint_metadata") if swapped.startswith("before") else (SafeReader, "read_metadata")
    read = getattr(owner, name)

    def read_then_swap(*args, **kwargs):
        metadata = read(*args, **kwargs)
        (saved / "__0_0.distcp").unlink()
        os.symlink(outside, saved / "__0_0.distcp")
        return metadata

    monkeypatch.setattr(owner, name, read_then_swap)
    expected = rf"{saved / '__0_0.distcp'} \(named by .*\) is, or leads through, a symbolic link"
    with pytest.raises(UntrustedInput, match=expected):
        _manager(saved.parent).load(saved)


def _compressed(tensor: torch.Tensor) -> bytes:
    """`tensor`'s torch.save archive with its records deflated, which torch.load reads (and inflates) too."""
    buffer, out = io.BytesIO(), io.BytesIO()
    torch.save(tensor, buffer)
    with zipfile.ZipFile(buffer) as archive, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as deflated:
        for name in archive.namelist():
            deflated.writestr(name, archive.read(name))
    return out.getvalue()


@pytest.mark.parametrize(
    "form, why",
    [("legacy", "is refused: it is not in torch.save's zip format"), ("compressed", "is compressed"),
     ("not-a-tensor", "holds a dict, not a tensor"), ("truncated", "its zip directory is damaged"),
     ("garbled-pickle", "cannot be read as a tensor")],
)  # fmt: skip
def test_tensor_bytes_in_a_form_dcp_never_writes_are_refused(saved, form, why):
    weight = torch.zeros(4, 4)
    buffer = io.BytesIO()
    torch.save(weight if form != "not-a-tensor" else {"w": weight}, buffer)
    data = {
        "legacy": legacy_format(weight),
        "compressed": _compressed(weight),
        "truncated": buffer.getvalue()[: len(buffer.getvalue()) // 2] + bytes(64),
        "garbled-pickle": _with_record(buffer.getvalue(), "data.pkl", b"\x80\x02garbage."),
    }.get(form, buffer.getvalue())
    replace_entry_bytes(saved, "model.weight", data)
    with pytest.raises(TorchpreError, match=rf"{saved / '__0_0.distcp'}: the entry 'model.weight' \(bytes .*{why}"):
        _manager(saved.parent).load(saved)


# Non-tensor entries of older checkpoints ----------------------------------------------------------------------------


def test_the_fixtures_non_tensor_entries_decode_as_torch_load_reads_them_without_calling_it(monkeypatch):
    metadata = read_pickled_metadata((OLD_CHECKPOINT / ".metadata").read_bytes(), OLD_CHECKPOINT / ".metadata")
    data = (OLD_CHECKPOINT / "__0_0.distcp").read_bytes()
    entries = {}
    for index, info in metadata.storage_data.items():
        if isinstance(metadata.state_dict_metadata[index.fqn], BytesStorageMetadata):
            entries[index.fqn] = data[info.offset : info.offset + info.length]
    expected = {fqn: torch.load(io.BytesIO(blob), weights_only=True) for fqn, blob in entries.items()}
    monkeypatch.setattr(torch, "load", None)  # read_plain_value must not need it
    assert {fqn: read_plain_value(blob) for fqn, blob in entries.items()} == expected
    assert expected["train.step"] == 2 and expected["lr_scheduler.base_lrs"] == [0.0008, 0.0008]


def test_a_legacy_format_entry_is_refused_before_anything_is_allocated(monkeypatch):
    """torch.load of these few hundred bytes would allocate 2.8 GB for the storage they claim."""
    claim = legacy_format(torch.zeros(1), numel=700_000_000)
    monkeypatch.setattr(torch, "load", None)
    with pytest.raises(NotAnArchive, match="it is not in torch.save's zip format"):
        read_plain_value(claim)


@pytest.mark.parametrize("form", ["too-large", "compressed", "a-tensor", "two-pickles"])
def test_entries_beyond_a_plain_value_are_refused(form):
    buffer = io.BytesIO()
    torch.save(torch.zeros(2) if form == "a-tensor" else [1.5], buffer)
    data = {
        "too-large": buffer.getvalue() + bytes(MAX_PLAIN_VALUE),
        "compressed": _compressed(torch.zeros(2)),
        "two-pickles": _with_record(buffer.getvalue(), "other/data.pkl", pickle.dumps(1)),
    }.get(form, buffer.getvalue())
    expected = {"too-large": f"a plain value is read from at most {MAX_PLAIN_VALUE:,}", "compressed": "is compressed",
                "a-tensor": "it holds tensor storages", "two-pickles": "2 data.pkl records"}[form]  # fmt: skip
    with pytest.raises((NotAnArchive, Refused), match=expected):
        read_plain_value(data)


def _with_record(archive: bytes, name: str, content: bytes) -> bytes:
    """The torch.save archive `archive` with the record ending in `name` replaced by `content` (added if none)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(archive)) as source, zipfile.ZipFile(out, "w") as copy_:
        names = source.namelist()
        for record in names:
            copy_.writestr(record, content if record.endswith(f"/{name}") else source.read(record))
        if not any(record.endswith(f"/{name}") for record in names):
            copy_.writestr(name, content)
    return out.getvalue()


def test_a_legacy_entry_in_legacy_format_is_refused_by_the_load(saved):
    legacy_checkpoint(saved, "train.step", 2)
    assert _loaded_step(_manager(saved.parent), saved) == 2
    replace_entry_bytes(saved, "train.step", legacy_format(torch.zeros(1), numel=700_000_000))
    with pytest.raises(UntrustedInput, match="entry 'train.step': it is no plain value .*not in torch.save's zip"):
        _manager(saved.parent).load(saved)


def test_chunks_tile_exactly_when_their_elements_add_up_and_every_cell_is_covered(genuine):
    """The tiling check on a tensor with many chunks of uneven sizes, against every chunk dropped in turn."""
    metadata, source, sizes = genuine
    boxes = [((0, 0), (1, 4)), ((1, 0), (2, 1)), ((1, 1), (2, 3)), ((3, 0), (1, 4))]
    tiled = copy.deepcopy(metadata)
    _weight(tiled).chunks.clear()
    for offsets, box in boxes:
        _add_chunk(tiled, offsets, box)
    assert check_metadata(tiled, source, sizes) is tiled
    for dropped in range(len(boxes)):
        partial = copy.deepcopy(tiled)
        del _weight(partial).chunks[dropped]
        assert math.prod(boxes[dropped][1]) > 0
        with pytest.raises(UntrustedInput, match="a gap or an overlap"):
            check_metadata(partial, source, sizes)
