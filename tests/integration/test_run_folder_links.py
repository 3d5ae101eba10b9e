"""No write of a run goes through a symbolic link, whoever put it there (issue 60): generated from genuine runs, not
from a hand list. A run that writes every kind of file a run folder gets (checkpoints with retention, metrics.jsonl,
config.toml, TensorBoard, evaluation samples, profiler traces, Hugging Face exports), and its resume from an earlier
step (which sets checkpoints and metrics records aside), are walked; then, for every path a run wrote (created,
changed or removed: `written`), a link to a target outside the folder is put in its place before that run, and the
run is repeated. Each time the outside targets stay byte for byte as they were and nothing is created outside; the
run either succeeds, the link replaced by a file or folder of its own (or left in place: where the run writes under
a fresh name instead, where it would only have removed a folder of its own, or named in a warning), or exits 2 with
one message naming the path or a folder holding it, never a traceback. The same for prepare's shard folder and for
`convert dcp-to-hf` and `hf-to-dcp`.

Links that a run meets one after another are put in place together, a depth of the tree at a time; when the run
refuses one, that one is taken out and the run repeated from a fresh copy, so each link is met by some run."""

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

import torchpre.data.prepare as prepare_module
from tests.launch import TINY, run_entry, run_train
from torchpre.errors import TorchpreError

pytestmark = pytest.mark.slow

EXIT_BAD_INPUT = 2
CHECKPOINTS = ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "2"]
EXPORTS = ["--hf_export.enable", "--hf_export.interval", "3", "--hf_export.keep_latest_k", "2"]
OBSERVED = ["--metrics.enable_tensorboard", "--profiling.enable_profiling", "--profiling.profile_freq", "3",
            "--eval.freq", "3"]  # fmt: skip
# Names a run never writes again, so a link there stays: TensorBoard's event files (named by time and process),
# and what a run sets aside under a fresh name (it takes the next free one, beside a link of that name).
FRESH_NAMES = re.compile(r"(^|/)(events\.out\.tfevents\..*|superseded-from-step-\d+.*|replaced-step-\d+.*"
                         r"|metrics\.superseded-from-step-\d+.*\.jsonl)$")  # fmt: skip
OUTSIDE_BYTES = b"outside the run folder\n"
_MISSING = object()


def walk(folder: Path) -> list[str]:
    """Every file and folder under `folder`, relative, parents first."""
    paths = []
    for root, folders, files in os.walk(folder):
        for name in sorted(folders) + sorted(files):
            paths.append(str((Path(root) / name).relative_to(folder)))
    return sorted(paths, key=lambda path: (path.count("/"), path))


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """What `folder` holds, links not followed: each path's bytes (None for a folder)."""
    return {path: None if (folder / path).is_dir() else (folder / path).read_bytes() for path in walk(folder)}


def written(before: dict[str, bytes | None], after: dict[str, bytes | None]) -> list[str]:
    """The paths a run created, changed or removed (snapshots before and after it), with the folders holding them,
    parents first."""
    changed = {path for path in before.keys() | after.keys() if before.get(path, _MISSING) != after.get(path, _MISSING)}
    holding = {str(parent) for path in changed for parent in Path(path).parents if str(parent) != "."}
    return sorted(changed | holding, key=lambda path: (path.count("/"), path))


def place_links(folder: Path, paths: list[str], outside: Path, was: dict[str, bytes | None]) -> None:
    """Puts at each of `paths` in `folder` a symbolic link to a new target in `outside` (a file where a file was, a
    folder holding one file where a folder was), replacing what is there; parents are made as folders."""
    for number, path in enumerate(paths):
        target = outside / f"target-{number}"
        if was[path] is None:
            target.mkdir()
            (target / "kept.txt").write_bytes(OUTSIDE_BYTES)
        else:
            target.write_bytes(OUTSIDE_BYTES)
        link = folder / path
        if link.is_dir() and not link.is_symlink():
            shutil.rmtree(link)
        elif link.exists() or link.is_symlink():
            link.unlink()
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(target)


def check_every_link(
    paths: list[str],
    was: dict[str, bytes | None],
    fresh: Callable[[Path], None],
    run: Callable[[Path], tuple[int, str]],
    tmp_path: Path,
    given: Path,
    whole_folder: bool = False,
    removed: frozenset[str] = frozenset(),
) -> dict[str, str]:
    """Runs `run` on copies made by `fresh` with links at `paths`, one depth at a time, taking out each link a run
    refuses; asserts what the module docstring says after each run. `whole_folder`: a refusal may name the folder
    the run was given rather than a link in it (prepare and convert refuse an output folder that holds anything);
    `removed`: the paths the run only removes (retention), where a link stays, for torchpre removes only folders it
    made. Returns how each path came out: "refused", "replaced", "fresh name", "left" or "warned"."""
    outcomes: dict[str, str] = {}
    trial = 0
    for depth in sorted({path.count("/") for path in paths}):
        pending = [path for path in paths if path.count("/") == depth]
        while pending:
            trial += 1
            folder, outside = tmp_path / f"trial-{trial}" / given.name, tmp_path / f"trial-{trial}" / "outside"
            fresh(folder)
            outside.mkdir(parents=True)
            place_links(folder, pending, outside, was)
            before = snapshot(outside)
            code, log = run(folder)
            assert snapshot(outside) == before, f"a write went outside through a link at one of {pending}:\n{log}"
            assert "Traceback" not in log, log[-3000:]
            if code == EXIT_BAD_INPUT:
                error = "\n".join(line for line in log.splitlines() if line.startswith("error (rank"))
                named = [path for path in pending if names(error, folder / path)]
                if not named and whole_folder and names(error, folder):  # refused whole, for what it holds
                    named = pending
                if not named:  # a folder refused for a link in it (a checkpoint): take out one of its links at a time
                    named = [path for path in pending if names(error, (folder / path).parent)][:1]
                assert named, f"exit 2 names none of the links {pending}, nor a folder holding one:\n{log[-3000:]}"
                outcomes |= dict.fromkeys(named, "refused")
                pending = [path for path in pending if path not in named]
                continue
            assert code == 0, f"exit {code} with links at {pending}:\n{log[-3000:]}"
            for path in pending:
                if not (folder / path).is_symlink():
                    outcomes[path] = "replaced"
                elif FRESH_NAMES.search(path):
                    outcomes[path] = "fresh name"
                elif path in removed:
                    outcomes[path] = "left"
                else:
                    assert str(folder / path) in log, f"the link at {path} stayed, and no warning names it:\n{log}"
                    outcomes[path] = "warned"
            pending = []
    return outcomes


def names(error: str, path: Path) -> bool:
    """Whether `error` names `path` (not merely a path inside it)."""
    return re.search(re.escape(str(path)) + r"(?![\w/-]|\.\w)", error) is not None


def train(args: list[str], folder: Path) -> tuple[int, str]:
    result = run_train(args, 1, folder)
    return result.returncode, result.stdout + result.stderr


@pytest.fixture(scope="module")
def genuine(tmp_path_factory) -> dict:
    """The arguments of a run and of its resume from step 4, the folder after each, and what each wrote."""
    root = tmp_path_factory.mktemp("genuine")
    task = root / "task.jsonl"
    task.write_text("".join(json.dumps({"context": f"Question {i}:", "choices": [" yes", " no"], "answer": i % 2})
                            + "\n" for i in range(4)))  # fmt: skip
    first = [*TINY, "--training.steps", "6", *CHECKPOINTS, *EXPORTS, *OBSERVED, "--eval.tasks", str(task)]
    resume = [*first, "--training.steps", "8", "--checkpoint.load_step", "4"]
    run1, run2 = root / "run1" / "run", root / "run2" / "run"
    code, log = train(first, run1)
    assert code == 0, log[-3000:]
    shutil.copytree(run1, run2, symlinks=True)
    code, log = train(resume, run2)
    assert code == 0, log[-3000:]
    assert (run2 / "checkpoint" / "superseded-from-step-4" / "step-6").is_dir()  # the resume set things aside
    assert (run2 / "metrics.superseded-from-step-4.jsonl").is_file()
    return {"first": first, "resume": resume, "run1": run1, "run2": run2}


def test_no_write_of_a_run_goes_through_a_link_in_its_folder(genuine, tmp_path):
    """Every path the first run wrote, as a link in an empty dump folder before it runs."""
    paths = written({}, snapshot(genuine["run1"]))
    assert {"config.toml", "metrics.jsonl", "checkpoint/step-6/.torchpre-checkpoint", "hf/step-6/config.json",
            "tensorboard", "eval/task/step-6.jsonl", "profile_traces/step-3/rank0_trace.json"} <= set(paths)
    was = snapshot(genuine["run1"])
    outcomes = check_every_link(paths, was, lambda folder: folder.mkdir(parents=True),
                                lambda folder: train(genuine["first"], folder), tmp_path, genuine["run1"])  # fmt: skip
    assert outcomes["config.toml"] == "replaced"
    for refused in ("metrics.jsonl", "checkpoint", "hf", "tensorboard", "eval", "profile_traces"):
        assert outcomes[refused] == "refused", refused
    assert outcomes["checkpoint/step-6"] == "refused"  # a linked step is never loaded: the run names it and stops
    assert outcomes["hf/step-6"] == "replaced"  # moved aside, never followed


def test_no_write_of_a_resume_from_an_earlier_step_goes_through_a_link(genuine, tmp_path):
    """Every path the run and its resume wrote, as a link in a copy of the run's folder before the resume: what it
    reads back of its own files (the loaded checkpoint, metrics.jsonl and the records set aside) is refused, what it
    writes is replaced."""
    before, after = snapshot(genuine["run1"]), snapshot(genuine["run2"])
    paths, was = written(before, after), before | after
    assert "checkpoint/step-4/state.json" in paths  # removed by retention after it was loaded

    def fresh(folder: Path) -> None:
        shutil.copytree(genuine["run1"], folder, symlinks=True)

    outcomes = check_every_link(paths, was, fresh, lambda folder: train(genuine["resume"], folder), tmp_path,
                                genuine["run1"], removed=frozenset(before.keys() - after.keys()))  # fmt: skip
    assert outcomes["metrics.jsonl"] == "refused"
    assert outcomes["checkpoint/step-4/state.json"] == "refused"
    assert outcomes["config.toml"] == outcomes["checkpoint/step-8/manifest.json"] == "replaced"
    assert outcomes["metrics.superseded-from-step-4.jsonl"] == "refused"  # read: the steps W&B holds
    assert outcomes["checkpoint/step-6"] == outcomes["eval/task/step-8.jsonl"] == "replaced"
    assert outcomes["hf/step-3"] == "left"  # retention removes only real step folders


def test_no_write_of_prepare_goes_through_a_link_in_its_shard_folder(tmp_path, monkeypatch):
    """prepare into an empty folder holding links is refused (it is no shard folder). Resuming a prepare interrupted
    after its first shard (made in this process, as tests/unit/test_prepare.py makes one), it writes the shards still
    to come as files of its own where links stood; a manifest or a journal that is a link is refused."""
    text = tmp_path / "input.jsonl"
    text.write_text("".join(json.dumps({"text": f"document {i} " + "word " * (20 + i)}) + "\n" for i in range(40)))
    complete, interrupted = tmp_path / "genuine" / "shards", tmp_path / "interrupted" / "shards"

    def prepare(folder: Path) -> tuple[int, str]:
        result = run_entry("torchpre.data.prepare", [str(text), "--output", str(folder), "--shard-tokens", "400"])
        return result.returncode, result.stdout + result.stderr

    code, log = prepare(complete)
    assert code == 0, log
    write_shard = prepare_module.write_shard

    def interrupt_after_the_first_shard(folder, name, documents, vocab_size):
        if name != "shard_00000":
            raise KeyboardInterrupt
        return write_shard(folder, name, documents, vocab_size)

    monkeypatch.setattr(prepare_module, "write_shard", interrupt_after_the_first_shard)
    with pytest.raises(TorchpreError, match="Interrupted with 1 shards written"):
        prepare_module.main([str(text), "--output", str(interrupted), "--shard-tokens", "400", "--workers", "1"])
    before, after = snapshot(interrupted), snapshot(complete)
    assert len([path for path in after if path.endswith(".bin")]) >= 3 and "shard_00001.bin" not in before
    into_empty = check_every_link(written({}, after), after, lambda folder: folder.mkdir(parents=True), prepare,
                                  tmp_path / "empty", complete, whole_folder=True)  # fmt: skip
    assert set(into_empty.values()) == {"refused"}
    resumed = check_every_link(written(before, after), before | after,
                               lambda folder: shutil.copytree(interrupted, folder), prepare, tmp_path / "resumed",
                               complete)  # fmt: skip
    # the manifest and the journal listing the shards written since (removed when prepare is done) are read first
    assert resumed.pop("manifest.json") == resumed.pop("manifest.journal") == "refused"
    assert resumed and set(resumed.values()) == {"replaced"}


def test_no_write_of_convert_goes_through_a_link_at_its_output(genuine, tmp_path):
    """dcp-to-hf and hf-to-dcp: a link as the output folder, or links in it, are refused and nothing is written."""
    config = ["--job.config_file", str(genuine["run1"] / "config.toml")]
    sources = {"dcp-to-hf": genuine["run1"] / "checkpoint" / "step-6", "hf-to-dcp": genuine["run1"] / "hf" / "step-6"}
    for command, source in sources.items():
        output = tmp_path / command / "genuine" / "out"

        def convert(folder: Path) -> tuple[int, str]:
            result = run_entry("torchpre.convert", [command, str(source), str(folder), *config])
            return result.returncode, result.stdout + result.stderr

        code, log = convert(output)
        assert code == 0, log[-3000:]
        at_output = check_every_link(["."], {".": None}, lambda folder: folder.parent.mkdir(parents=True),
                                     convert, tmp_path / command / "link", output)  # fmt: skip
        inside = check_every_link(walk(output), snapshot(output), lambda folder: folder.mkdir(parents=True), convert,
                                  tmp_path / command / "inside", output, whole_folder=True)  # fmt: skip
        assert set(at_output.values()) == set(inside.values()) == {"refused"}, (at_output, inside)
