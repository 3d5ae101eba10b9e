"""The one way to read a file from a folder someone else made, and to write one into a run folder
(torchpre/confined/read.py, write.py), and JSON from others parsed within bounds (torchpre/json_input.py): each under
openat2 and under the per-component fallback that kernels without openat2 take."""

import os
from pathlib import Path

import pytest

import torchpre.confined as confined
from torchpre.errors import UntrustedInput
from torchpre.json_input import MAX_DEPTH, loads, nesting_depth


@pytest.fixture(params=["openat2", "components"])
def opener(request, monkeypatch):
    if request.param == "openat2" and not confined.openat2_available():
        pytest.skip("this kernel has no openat2")
    if request.param == "components":
        monkeypatch.setattr(confined.read._openat2, "available", False)
    return request.param


@pytest.fixture
def folder(tmp_path) -> Path:
    """A folder with a file, a subfolder's file, a link out, a link to its own subfolder, a FIFO and a folder."""
    root = tmp_path / "folder"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "f").write_bytes(b"inner")
    (root / "a").write_bytes(b"abc")
    (tmp_path / "outside").write_bytes(b"secret")
    os.symlink(tmp_path / "outside", root / "link")
    os.symlink("sub", root / "dirlink")
    os.symlink("a", root / "samefolderlink")
    os.mkfifo(root / "fifo")
    return root


CASES = {
    "a": ("file", b"abc"),
    "sub/f": ("file", b"inner"),
    "./a": ("file", b"abc"),
    "link": ("link", UntrustedInput),
    "samefolderlink": ("link", UntrustedInput),
    "dirlink/f": ("link", UntrustedInput),
    "fifo": ("other", UntrustedInput),
    "sub": ("other", UntrustedInput),
    "missing": ("missing", FileNotFoundError),
    "a/b": ("missing", FileNotFoundError),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_file_is_read_only_when_it_is_a_regular_file_reached_without_a_link(opener, folder, name):
    kind, content = CASES[name]
    assert confined.file_kind(folder, name) == kind
    if isinstance(content, bytes):
        assert confined.read_file(folder, name, 100) == content
    else:
        with pytest.raises(content) as error:
            confined.read_file(folder, name, 100)
        assert str(folder / name) in str(error.value)


def test_a_file_the_user_names_may_be_a_link_but_must_be_a_regular_file(folder):
    """A key or an argument names the path: a link on it is the user's choice (a tokenizer in a model cache), but a
    FIFO would block the job and a folder is no file."""
    assert confined.read_named(folder / "link", 100) == b"secret"
    assert confined.read_named(folder / "dirlink" / "f", 100) == b"inner"
    for name, message in (("fifo", "not a regular file"), ("sub", "is a folder"), ("a", "holds 3 bytes")):
        with pytest.raises(UntrustedInput, match=message):
            confined.read_named(folder / name, 2)
    with pytest.raises(FileNotFoundError):
        confined.open_named(folder / "missing")


def test_a_file_over_its_bound_is_refused_before_it_is_read(folder):
    with pytest.raises(UntrustedInput, match=r"a holds 3 bytes; a file of this kind holds at most 2"):
        confined.read_file(folder, "a", 2)


@pytest.mark.parametrize(
    "name, why",
    [("../outside", "climbs out of the folder with '..'"), ("/etc/passwd", "is an absolute path"),
     ("C:\\x", "is an absolute path"), ("a\x00b", "is not a file name"), (7, "is not a file name")],
)  # fmt: skip
def test_a_name_from_inside_a_file_is_checked_before_it_is_opened(folder, name, why):
    with pytest.raises(UntrustedInput) as error:
        confined.open_file(folder, name, folder / "index.json", "weight_map['w']")
    assert f"index.json: weight_map['w'] names {name!r}, which {why}" in str(error.value)


def test_a_link_at_a_written_name_is_replaced_never_written_through(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(victim, run / "config.toml")
    confined.write_file(run / "config.toml", "mine", durable=True)
    assert victim.read_text() == "keep" and not (run / "config.toml").is_symlink()
    assert (run / "config.toml").read_text() == "mine"
    assert sorted(p.name for p in run.iterdir()) == ["config.toml"], "a temporary file was left"


@pytest.mark.parametrize("target", ["file", "missing"])
def test_an_append_or_a_marker_through_a_link_is_refused(tmp_path, target):
    victim = tmp_path / "victim"
    if target == "file":
        victim.write_text("keep")
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(victim, run / "metrics.jsonl")
    os.symlink(victim, run / ".torchpre-checkpoint")
    with pytest.raises(UntrustedInput, match="metrics.jsonl is a symbolic link"):
        confined.open_for_append(run / "metrics.jsonl")
    with pytest.raises(UntrustedInput, match=".torchpre-checkpoint is not a regular file"):
        confined.touch_marker(run / ".torchpre-checkpoint")
    assert (victim.read_text() == "keep") if target == "file" else not victim.exists()


@pytest.mark.parametrize("what", ["folder", "fifo"])
def test_an_append_to_a_folder_or_a_fifo_is_refused_by_name(tmp_path, what):
    """Found by the fuzzer: metrics.jsonl as a folder, or a FIFO no one reads (ENXIO), ended in a traceback."""
    (tmp_path / "m.jsonl").mkdir() if what == "folder" else os.mkfifo(tmp_path / "m.jsonl")
    with pytest.raises(UntrustedInput, match="m.jsonl is not a regular file, where torchpre writes a file"):
        confined.open_for_append(tmp_path / "m.jsonl")


def test_an_append_goes_to_the_end_of_a_regular_file_and_a_marker_is_kept(tmp_path):
    (tmp_path / "m.jsonl").write_bytes(b"1\n")
    with confined.open_for_append(tmp_path / "m.jsonl") as file:
        file.write(b"2\n")
    assert (tmp_path / "m.jsonl").read_bytes() == b"1\n2\n"
    confined.touch_marker(tmp_path / "marker")
    confined.touch_marker(tmp_path / "marker")
    assert confined.is_regular_file(tmp_path / "marker")


@pytest.mark.parametrize(
    "text, message",
    [(b"[" * 5000, "nests more than a thousand levels deep"),
     (b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1), f"nests {MAX_DEPTH + 1} levels deep"),
     (b"1" * 5000, "holds an integer of 5,000 digits"), (b'{"a": -' + b"9" * 31 + b"}", "integer of 31 digits"),
     (b"\xff", "is not UTF-8 text"), (b"{", "is not valid JSON"), (b"", "is not valid JSON")],
)  # fmt: skip
def test_json_from_others_is_bounded_before_it_can_hurt(text, message):
    with pytest.raises(UntrustedInput, match=message) as error:
        loads(text, Path("/x/manifest.json"))
    assert str(error.value).startswith("/x/manifest.json")


def test_json_within_bounds_parses_as_json_does():
    text = b'{"a": [1, 2.5, NaN, "[[["], "b": {"c": -' + b"9" * 30 + b"}}"
    value = loads(text, Path("f"))
    assert value["a"][:2] == [1, 2.5] and value["a"][2] != value["a"][2] and value["b"]["c"] == -int("9" * 30)
    assert nesting_depth(value) == 2 and nesting_depth(3) == 0
    assert nesting_depth(loads(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH, Path("f"))) == MAX_DEPTH
