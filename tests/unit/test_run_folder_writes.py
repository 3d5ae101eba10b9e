"""The writers of a run folder, one at a time, against a symbolic link where they write (issue 60): a marker is never
touched through one, metrics.jsonl never appended or read through one, the records set aside take a fresh name
beside one, a folder torchpre writes into is refused when it is one, a shard replaces one, and the stages a resume
compares come from the checkpoint's data, checked like any input (tests/integration/test_run_folder_links.py runs
the whole of it)."""

import logging
import os
from pathlib import Path

import numpy as np
import pytest

from torchpre.checkpoint.folders import MARKER, complete_steps, mark_as_ours, remove_step
from torchpre.checkpoint.history import set_aside_earlier_metrics, set_aside_later_records
from torchpre.checkpoint.published import StepFolders
from torchpre.config.job_config import JobConfig
from torchpre.confined import make_folder, write_file
from torchpre.data.shards import write_shard
from torchpre.errors import TorchpreError, UntrustedInput
from torchpre.metrics.sinks import JsonlSink, last_logged_step
from torchpre.training.run_folder import check_run_folder
from torchpre.training.stages import SAVED_KEY, Stage, StageTable, saved_stages

OUTSIDE = b"outside\n"


@pytest.fixture
def outside(tmp_path) -> Path:
    """A file outside the run folder (`tmp_path / "run"`), which no write may change."""
    path = tmp_path / "outside.txt"
    path.write_bytes(OUTSIDE)
    (tmp_path / "run").mkdir()
    return path


def test_a_marker_is_never_touched_through_a_link_and_retention_keeps_that_step(tmp_path, outside):
    step = tmp_path / "run" / "step-4"
    step.mkdir()
    (step / MARKER).symlink_to(outside)
    with pytest.raises(UntrustedInput, match=f"{step / MARKER} is not a regular file"):
        mark_as_ours(step)
    with pytest.raises(UntrustedInput):
        remove_step(step)
    assert outside.read_bytes() == OUTSIDE and complete_steps(tmp_path / "run") == [4]
    (step / MARKER).unlink()
    (step / MARKER).symlink_to(tmp_path / "created-outside")  # dangling: touching it would create its target
    with pytest.raises(UntrustedInput):
        mark_as_ours(step)
    assert not (tmp_path / "created-outside").exists()


def test_a_step_folder_that_is_a_link_is_no_checkpoint(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "run" / "step-2").mkdir(parents=True)
    (tmp_path / "run" / "step-6").symlink_to(tmp_path / "elsewhere")
    assert complete_steps(tmp_path / "run") == [2]


def test_metrics_jsonl_is_never_appended_or_read_through_a_link(tmp_path, outside):
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.symlink_to(outside)
    with pytest.raises(UntrustedInput, match=f"{metrics} is a symbolic link"):
        JsonlSink(tmp_path / "run")
    with pytest.raises(UntrustedInput, match=f"{metrics} is, or leads through, a symbolic link"):
        last_logged_step(metrics)
    with pytest.raises(UntrustedInput):
        set_aside_later_records(metrics, 2)
    assert outside.read_bytes() == OUTSIDE


def test_the_records_set_aside_take_a_fresh_name_beside_a_link_and_replace_metrics_jsonl(tmp_path, outside):
    run = tmp_path / "run"
    (run / "metrics.jsonl").write_text("".join(f'{{"step": {step}}}\n' for step in (1, 2, 3, 4)))
    (run / "metrics.superseded-from-step-2.jsonl").symlink_to(outside)
    moved = set_aside_later_records(run / "metrics.jsonl", 2)
    assert moved == run / "metrics.superseded-from-step-2-2.jsonl"
    assert moved.read_text() == '{"step": 3}\n{"step": 4}\n'
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    assert outside.read_bytes() == OUTSIDE and sorted(p.name for p in run.iterdir()) == [
        "metrics.jsonl", "metrics.superseded-from-step-2-2.jsonl", "metrics.superseded-from-step-2.jsonl"
    ]  # fmt: skip


def test_an_earlier_runs_metrics_are_moved_aside_but_never_inside_a_linked_folder(tmp_path):
    """A `wandb` link to someone's folder: its run_id is not this folder's, so nothing is renamed inside it."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "run_id").write_text("abc")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "wandb").symlink_to(theirs)
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    assert set_aside_earlier_metrics(tmp_path / "run") == [tmp_path / "run" / "metrics.1.jsonl"]
    assert [p.name for p in theirs.iterdir()] == ["run_id"]


def test_a_folder_torchpre_writes_into_is_refused_when_it_is_a_link(tmp_path, outside):
    run = tmp_path / "run"
    (tmp_path / "theirs").mkdir()
    (run / "tensorboard").symlink_to(tmp_path / "theirs")
    (run / "eval").symlink_to(tmp_path / "missing")
    (run / "wandb").symlink_to(outside)
    for name in ("tensorboard", "eval", "wandb", "eval/task"):
        with pytest.raises(UntrustedInput, match=f"{run / name.split('/')[0]} is a symbolic link, where torchpre"):
            make_folder(run, name)
    assert make_folder(run, "new/deeper") == run / "new" / "deeper" and (run / "new" / "deeper").is_dir()
    assert make_folder(run, tmp_path / "theirs") == tmp_path / "theirs"  # an absolute path is the caller's choice
    assert not (tmp_path / "missing").exists() and list((tmp_path / "theirs").iterdir()) == []


@pytest.mark.parametrize("name", ["checkpoint", "hf", "tensorboard", "wandb", "eval", "profile_traces",
                                  "comm_traces", "metrics.jsonl"])  # fmt: skip
def test_the_run_folder_is_refused_on_every_rank_when_a_folder_it_writes_into_is_a_link(tmp_path, name):
    config = JobConfig()
    config.job.dump_folder = str(tmp_path / "run")
    (tmp_path / "theirs").mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / name).symlink_to(tmp_path / "theirs")
    with pytest.raises(UntrustedInput, match=f"{tmp_path / 'run' / name} is, or leads through, a symbolic link"):
        check_run_folder(config)


def test_a_folder_given_by_its_own_path_may_be_a_link(tmp_path):
    config = JobConfig()
    config.job.dump_folder = str(tmp_path / "run")
    (tmp_path / "disk").mkdir()
    (tmp_path / "checkpoints").symlink_to(tmp_path / "disk")
    config.checkpoint.folder = str(tmp_path / "checkpoints")
    config.hf_export.folder = "../exports"
    (tmp_path / "run").mkdir()
    (tmp_path / "exports").symlink_to(tmp_path / "disk")
    check_run_folder(config)


def test_a_shard_replaces_a_link_at_its_name(tmp_path, outside):
    run = tmp_path / "run"
    (run / "shard_00001.bin").symlink_to(outside)
    (run / "shard_00001.idx").symlink_to(tmp_path / "created-outside")
    info = write_shard(run, "shard_00001", [[1, 5, 2], [1, 2]], vocab_size=100)
    assert info.num_tokens == 5 and not (run / "shard_00001.bin").is_symlink()
    assert np.fromfile(run / "shard_00001.bin", dtype="<u2").tolist() == [1, 5, 2, 1, 2]
    assert np.fromfile(run / "shard_00001.idx", dtype="<i8").tolist() == [0, 3, 5]
    assert outside.read_bytes() == OUTSIDE and not (tmp_path / "created-outside").exists()


def test_the_saved_stages_are_data_read_back_as_written():
    table = StageTable([Stage(0, "main", 0, 32, {"/web": 0.7, "/code": 0.3}), Stage(1, "anneal", 6, 64, {"/hq": 1.0})])
    assert saved_stages(table.record(), Path("step-6")).stages == table.stages
    assert saved_stages(None, Path("step-6")) is None  # saved before the stages were


@pytest.mark.parametrize(
    "record, why",
    [
        ([], "not a non-empty array of stages"),
        ({"start_step": 0}, "not a non-empty array of stages"),
        ([{"name": "a", "start_step": 2, "seq_len": 32, "mixture": {}}], "'[0].start_step' is 2"),
        ([{"name": "a", "start_step": 0, "seq_len": 32, "mixture": {}},
          {"name": "b", "start_step": 0, "seq_len": 32, "mixture": {}}], "'[1].start_step' is 0"),
        ([{"name": "a", "start_step": 0, "seq_len": -1, "mixture": {}}], "a seq_len of -1"),
        ([{"name": "a", "start_step": 0, "seq_len": 32, "mixture": {"/w": float("nan")}}], "no finite number"),
        ([{"name": "a", "start_step": 0, "seq_len": 32, "mixture": {"/w": "1"}}], "'[0].mixture./w' is \"1\""),
        ([{"name": "a", "start_step": True, "seq_len": 32, "mixture": {}}], "'[0].start_step' is true"),
        ([{"name": "a", "seq_len": 32, "mixture": {}}], "'[0].start_step' is missing"),
    ],
)  # fmt: skip
def test_malformed_saved_stages_are_an_error_naming_the_file_and_key(record, why):
    with pytest.raises(TorchpreError) as error:
        saved_stages(record, Path("run/checkpoint/step-6"))
    message = str(error.value)
    assert message.startswith(f"run/checkpoint/step-6/state.json: {SAVED_KEY} is no table of data stages (")
    assert why in message


def test_retention_keeps_a_step_whose_marker_is_a_link_and_says_so(tmp_path, outside, caplog):
    """Retention (checkpoints' and exports'): a step it cannot mark (its marker a link) stays, with a warning; the
    save that triggered retention is not failed by it."""
    folder = tmp_path / "run"
    for step in (2, 4, 6):
        (folder / f"step-{step}").mkdir()
    (folder / "step-2" / MARKER).symlink_to(outside)
    steps = StepFolders(folder, "checkpoint.folder", "checkpoint", keep_latest_k=1, keeps_marker=True)
    with caplog.at_level(logging.WARNING, logger="torchpre"):
        steps.keep_newest()
    assert complete_steps(folder) == [2, 6] and outside.read_bytes() == OUTSIDE
    assert f"could not remove the old checkpoint step-2 ({folder / 'step-2' / MARKER} is not a regular file" in (
        caplog.text
    )
    assert os.path.islink(folder / "step-2" / MARKER)


def test_a_folder_at_a_name_torchpre_writes_is_refused_by_name(tmp_path):
    """config.toml, metrics records, a shard: a folder in place of the file is bad input (exit 2), not a crash."""
    (tmp_path / "config.toml").mkdir()
    with pytest.raises(UntrustedInput, match=f"{tmp_path / 'config.toml'} is a folder, where torchpre writes a file"):
        write_file(tmp_path / "config.toml", "x")
    assert [path.name for path in tmp_path.iterdir()] == ["config.toml"], "a temporary file was left"


@pytest.mark.parametrize("what", ["a folder without the marker", "a link"])
def test_a_save_refuses_a_tmp_folder_torchpre_did_not_make_on_every_rank(world, tmp_path, outside, what):
    """A `.tmp-step-N` in the way is never removed: the save stops every rank with exit 2 naming it (not a storage
    failure: the disk is fine)."""
    from tests.unit.test_checkpoint_integrity import _manager

    folder = tmp_path / "checkpoint"
    folder.mkdir()
    if what == "a link":
        (folder / ".tmp-step-2").symlink_to(outside)
    else:
        (folder / ".tmp-step-2").mkdir()
    with pytest.raises(UntrustedInput, match=r"\.tmp-step-2 is in the way of the checkpoint of step 2"):
        _manager(folder).save(2)
    assert (folder / ".tmp-step-2").is_symlink() or (folder / ".tmp-step-2").is_dir()
