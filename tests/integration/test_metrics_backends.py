"""Weights & Biases (offline) and TensorBoard end to end through train.py: both hold every record of
metrics.jsonl under the same names at the same steps, plus the resolved config; a job resumed after a
crash continues the same W&B run and TensorBoard directory with each step once, and a new run in the
folder starts its own."""

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from tests.launch import TINY, run_train, train_and_read_metrics
from torchpre.config.job_config import JobConfig
from torchpre.plot import plot_runs, read_metrics

pytestmark = pytest.mark.slow
pytest.importorskip("wandb")
pytest.importorskip("tensorboard")
pytest.importorskip("matplotlib")

TOLERANCE = 1e-6  # relative: TensorBoard stores float32; W&B keeps the JSON float64 exactly
RESUME_ATOL = 1e-6  # a resumed fp32 CPU run on the same layout redoes a step's loss exactly (test_faults)
TRACKERS = ["--metrics.enable_wandb", "--metrics.enable_tensorboard"]


@pytest.fixture(autouse=True, scope="module")
def wandb_offline():
    """W&B on disk only: no network, no account."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("WANDB_SILENT", "true")
        yield


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, list[dict]]:
    """One 3-step tiny job with both trackers on."""
    folder = tmp_path_factory.mktemp("trackers")
    args = [*TINY, "--training.steps", "3", *TRACKERS, "--metrics.wandb_run_name", "tiny-trackers"]
    return folder, train_and_read_metrics(args, 1, folder)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> tuple[Path, list[dict], list[dict]]:
    """A job that logged steps 1-5 and crashed while saving step 5 (checkpoints every 2 steps), then its
    restart with training.steps 8: it resumes step-4 and redoes step 5. Returns the folder and each
    attempt's records."""
    folder = tmp_path_factory.mktemp("resumed")
    args = [*TINY, "--training.deterministic", "--checkpoint.enable", "--checkpoint.interval", "2", *TRACKERS]
    first = train_and_read_metrics([*args, "--training.steps", "5"], 1, folder)
    (folder / "checkpoint" / "step-5").rename(folder / "checkpoint" / ".tmp-step-5")  # the unfinished save
    records = train_and_read_metrics([*args, "--training.steps", "8"], 1, folder)
    return folder, first, records[len(first) :]


def read_wandb_records(path: Path) -> list[Any]:
    """The protobuf records of an offline run's .wandb file: a 7-byte W&B header, then LevelDB's log
    format (32 KiB blocks of chunks, each with a 7-byte header: crc32, length, type full/first/middle/last)."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    block, header = 32768, 7
    position, pending, records = header, b"", []
    while position + header <= len(data):
        if block - position % block < header:  # the block's tail is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + header])
        if kind == 0:  # zero padding at the end of the file
            break
        pending += data[position + header : position + header + length]
        position += header + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_runs(folder: Path) -> list[tuple[Any, dict[int, dict]]]:
    """Each offline W&B attempt under `folder/wandb`, oldest first: its run record and its history by step
    (a step logged twice in one attempt fails)."""
    attempts = []
    for log in sorted(folder.glob("wandb/offline-run-*/run-*.wandb"), key=lambda path: path.parent.name):
        run, history = None, {}
        for record in read_wandb_records(log):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run = record.run
            elif kind == "history":
                row = {item.nested_key[0] if item.nested_key else item.key: json.loads(item.value_json)
                       for item in record.history.item}
                step = row.pop("_step")
                assert step not in history, f"{log} logs step {step} twice"
                history[step] = {name: value for name, value in row.items() if not name.startswith("_")}
        attempts.append((run, history))
    return attempts


def metrics_of(record: dict) -> dict:
    return {name: value for name, value in record.items() if name != "step"}


def assert_same_metrics(logged: dict, record: dict) -> None:
    """`logged` holds `record`'s metrics: the numbers within TOLERANCE, the labels (`mfu_peak`) as they are."""
    numbers = {name: value for name, value in metrics_of(record).items() if not isinstance(value, str)}
    labels = {name: value for name, value in metrics_of(record).items() if isinstance(value, str)}
    logged_numbers = {name: value for name, value in logged.items() if name not in labels}
    assert logged_numbers == pytest.approx(numbers, rel=TOLERANCE)
    assert {name: logged.get(name) for name in labels} == labels


def test_a_resumed_job_continues_its_wandb_run_with_each_step_once(resumed):
    """Both attempts write to the run id the folder stores, the second as a resume; together they hold
    steps 1-8 once each. Step 5, redone, keeps the first attempt's record in W&B: the same loss and grad norm."""
    folder, first, second = resumed
    assert [r["step"] for r in first] == [1, 2, 3, 4, 5] and [r["step"] for r in second] == [5, 6, 7, 8]
    (first_run, first_history), (second_run, second_history) = wandb_runs(folder)
    run_id = (folder / "wandb" / "run_id").read_text()
    assert first_run.run_id == second_run.run_id == run_id
    assert not first_run.resume and second_run.resume
    assert sorted(first_history) == [1, 2, 3, 4, 5] and sorted(second_history) == [6, 7, 8]
    for record in first:
        assert_same_metrics(first_history[record["step"]], record)
    for record in second[1:]:
        assert_same_metrics(second_history[record["step"]], record)
    for name in ("loss", "grad_norm"):  # the lr differs: the restart's training.steps reshapes the schedule
        assert second[0][name] == pytest.approx(first_history[5][name], abs=RESUME_ATOL), name


def test_a_resumed_job_keeps_one_tensorboard_run_with_each_step_once(resumed):
    """The restart's event file purges the first attempt's steps after the checkpoint: each scalar shows
    steps 1-8 once, step 5 with the redone values (what read_metrics keeps); each attempt's config is
    there, at the step it started from."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder, first, second = resumed
    final = read_metrics(folder)
    assert final == first[:4] + second
    events = EventAccumulator(str(folder / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert len(list((folder / "tensorboard").iterdir())) == 2  # one event file per attempt, one directory
    names = {name for record in final for name, value in record.items() if not isinstance(value, str)} - {"step"}
    assert set(events.Tags()["scalars"]) == names
    for name in names:
        logged = [(event.step, event.value) for event in events.Scalars(name)]
        expected = [(record["step"], record[name]) for record in final if name in record]
        assert [step for step, _ in logged] == [step for step, _ in expected], name
        assert [value for _, value in logged] == pytest.approx([value for _, value in expected], rel=TOLERANCE)
    configs = {event.step: event.tensor_proto.string_val[0].decode() for event in events.Tensors("config/text_summary")}
    assert sorted(configs) == [0, 4]
    assert "steps = 5\n" in configs[0] and "steps = 8\n" in configs[4]


def test_a_new_run_in_a_used_folder_gets_its_own_wandb_run_and_tensorboard_directory(tmp_path):
    """No checkpoint to resume: the second job is a new run. It gets a new W&B id, and the first run's
    events move to tensorboard.1 next to metrics.1.jsonl (and its W&B id to wandb/run_id.1)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = [*TINY, *TRACKERS, "--training.steps", "2"]
    first = train_and_read_metrics(args, 1, tmp_path)
    first_id = (tmp_path / "wandb" / "run_id").read_text()
    result = run_train([*args, "--training.steps", "3"], 1, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "moved them to metrics.1.jsonl, tensorboard.1, wandb/run_id.1;" in result.stdout + result.stderr
    (old_run, old_history), (new_run, new_history) = wandb_runs(tmp_path)
    assert old_run.run_id == first_id == (tmp_path / "wandb" / "run_id.1").read_text()
    assert new_run.run_id != first_id and new_run.run_id == (tmp_path / "wandb" / "run_id").read_text()
    assert not new_run.resume
    assert sorted(old_history) == [1, 2] and sorted(new_history) == [1, 2, 3]
    assert [json.loads(line) for line in (tmp_path / "metrics.1.jsonl").read_text().splitlines()] == first
    for directory, steps in (("tensorboard.1", [1, 2]), ("tensorboard", [1, 2, 3])):
        events = EventAccumulator(str(tmp_path / directory), size_guidance={"scalars": 0})
        events.Reload()
        assert [event.step for event in events.Scalars("loss")] == steps, directory


def test_wandb_offline_run_holds_the_metrics_and_the_config(run):
    folder, records = run
    (log,) = (folder / "wandb").glob("offline-run-*/run-*.wandb")
    wandb_records = read_wandb_records(log)
    history = {}
    config = {}
    for record in wandb_records:
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {item.nested_key[0] if item.nested_key else item.key: json.loads(item.value_json)
                   for item in record.history.item}
            history[row.pop("_step")] = {name: value for name, value in row.items() if not name.startswith("_")}
        elif kind == "run":
            assert record.run.display_name == "tiny-trackers"
            assert record.run.project == "torchpre"
            config |= {item.key: json.loads(item.value_json) for item in record.run.config.update}
        elif kind == "config":
            config |= {item.key: json.loads(item.value_json) for item in record.config.update}

    assert sorted(history) == [record["step"] for record in records]
    for record in records:
        assert_same_metrics(history[record["step"]], record)
    assert set(JobConfig.__dataclass_fields__) <= set(config)
    assert config["training"]["steps"] == 3
    assert config["model"]["flavor"] == "tiny"
    assert config["metrics"]["enable_wandb"] is True


def test_tensorboard_holds_the_same_scalars_and_the_config(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder, records = run
    events = EventAccumulator(str(folder / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    # TensorBoard holds the numbers; a label (`mfu_peak`) stays in metrics.jsonl and the step line.
    names = {name for record in records for name, value in record.items() if not isinstance(value, str)} - {"step"}
    assert set(events.Tags()["scalars"]) == names
    for name in names:
        expected = {record["step"]: record[name] for record in records if name in record}
        logged = {event.step: event.value for event in events.Scalars(name)}
        assert logged == pytest.approx(expected, rel=TOLERANCE), name
    (config,) = events.Tensors("config/text_summary")
    assert (folder / "config.toml").read_text() in config.tensor_proto.string_val[0].decode()


def test_plot_overlays_the_run_with_itself(run):
    folder, _ = run
    figure = plot_runs([("first", read_metrics(folder)), ("second", read_metrics(folder))])
    lines = {axes.get_title(): len(axes.get_lines()) for axes in figure.axes}
    assert lines.pop("step time tail (s)") == 2 * 4  # p50, p90, p99 and max of each run
    assert lines and set(lines.values()) == {2}
