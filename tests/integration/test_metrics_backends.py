"""Weights & Biases (offline) and TensorBoard end to end through train.py: both hold every record of
metrics.jsonl under the same names at the same steps, plus the resolved config."""

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from tests.launch import TINY, train_and_read_metrics
from torchpre.config.job_config import JobConfig
from torchpre.plot import plot_runs, read_metrics

pytestmark = pytest.mark.slow
pytest.importorskip("wandb")
pytest.importorskip("tensorboard")
pytest.importorskip("matplotlib")

TOLERANCE = 1e-6  # relative: TensorBoard stores float32; W&B keeps the JSON float64 exactly


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, list[dict]]:
    """One 3-step tiny job with both trackers on, W&B offline (no network, no account)."""
    folder = tmp_path_factory.mktemp("trackers")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("WANDB_SILENT", "true")
        args = [*TINY, "--training.steps", "3", "--metrics.enable_wandb", "--metrics.enable_tensorboard",
                "--metrics.wandb_run_name", "tiny-trackers"]
        records = train_and_read_metrics(args, 1, folder)
    return folder, records


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
        expected = {name: value for name, value in record.items() if name != "step"}
        assert history[record["step"]] == pytest.approx(expected, rel=TOLERANCE)
    assert set(JobConfig.__dataclass_fields__) <= set(config)
    assert config["training"]["steps"] == 3
    assert config["model"]["flavor"] == "tiny"
    assert config["metrics"]["enable_wandb"] is True


def test_tensorboard_holds_the_same_scalars_and_the_config(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder, records = run
    events = EventAccumulator(str(folder / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    names = {name for record in records for name in record} - {"step"}
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
    assert figure.axes and all(len(axes.get_lines()) == 2 for axes in figure.axes)
