"""The metrics sinks and the plot command without training: TensorBoard scalars equal the records, the
plot draws one curve per run, and a missing optional package or metrics file is a clear error."""

import json
import sys
from pathlib import Path

import pytest

from torchpre.config.job_config import JobConfig
from torchpre.config.validate import validate_config
from torchpre.errors import TorchpreError
from torchpre.metrics.logger import MetricsLogger
from torchpre.metrics.sinks import JsonlSink, TensorBoardSink, WandbSink
from torchpre.plot import main as plot_main
from torchpre.plot import plot_runs, read_metrics

INSTALL_HINT = "pip install torchpre[metrics]"

TB_TOLERANCE = 1e-6  # relative: TensorBoard stores scalars as float32 (~6e-8 relative rounding)


def fake_records(steps: int, scale: float, val_every: int = 0) -> list[dict]:
    """Records shaped like the trainer's, with values that differ per step and per run."""
    records = []
    for step in range(1, steps + 1):
        record = {
            "step": step,
            "loss": scale * 8.0 / step,
            "lr": 1e-3 * step / steps,
            "grad_norm": scale / step,
            "tokens_per_sec": 12345.678 * step,
            "tokens_per_sec_per_device": 12345.678 * step,
            "mfu": 0.01 * step,
            "step_time_s": 0.1,
            "data_time_s": 0.001,
            "max_memory_bytes": 123456789,
            "optimizer_state_bytes": 4096,
        }
        if val_every and step % val_every == 0:
            record["val_loss"] = scale * 9.0 / step
        records.append(record)
    return records


def write_run(folder: Path, records: list[dict]) -> Path:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return folder


def test_tensorboard_sink_writes_the_records_scalars_and_the_config(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = fake_records(4, 1.0, val_every=2)
    records[1]["nonfinite/first_module"] = "layers.1"  # a string: TensorBoard keeps it as text
    metrics = MetricsLogger([JsonlSink(tmp_path), TensorBoardSink(tmp_path, "[training]\nsteps = 4\n")])
    for record in records:
        metrics.log(record)
    metrics.close()

    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == records
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert set(events.Tags()["scalars"]) == {name for record in records for name in record} - {
        "step", "nonfinite/first_module"
    }
    for name in events.Tags()["scalars"]:
        expected = {record["step"]: record[name] for record in records if name in record}
        logged = {event.step: event.value for event in events.Scalars(name)}
        assert logged == pytest.approx(expected, rel=TB_TOLERANCE), name
    (text,) = events.Tensors("nonfinite/first_module/text_summary")
    assert (text.step, text.tensor_proto.string_val[0].decode()) == (2, "layers.1")
    (config,) = events.Tensors("config/text_summary")
    assert "[training]\nsteps = 4" in config.tensor_proto.string_val[0].decode()


def test_plot_draws_one_curve_per_run_in_each_panel(tmp_path):
    pytest.importorskip("matplotlib")
    runs = [("a", fake_records(5, 1.0, val_every=2)), ("b", fake_records(3, 2.0))]
    figure = plot_runs(runs)
    panels = {axes.get_title(): axes for axes in figure.axes}
    assert set(panels) == {"loss", "validation loss", "learning rate", "grad norm (before clipping)",
                           "tokens/s (whole job)", "MFU (%)"}
    for title, axes in panels.items():
        labels = [line.get_label() for line in axes.get_lines()]
        assert labels == (["a"] if title == "validation loss" else ["a", "b"]), title
    loss_b = panels["loss"].get_lines()[1]
    assert list(loss_b.get_xdata()) == [1, 2, 3]
    assert list(loss_b.get_ydata()) == pytest.approx([16.0, 8.0, 16.0 / 3])


def test_plot_command_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    first = write_run(tmp_path / "run1", fake_records(4, 1.0))
    second = write_run(tmp_path / "run2", fake_records(4, 1.5))
    output = tmp_path / "out" / "curves.png"
    plot_main([str(first), str(second), "-o", str(output)])
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert output.stat().st_size > 10_000


def test_plot_without_validation_has_no_validation_panel(tmp_path):
    pytest.importorskip("matplotlib")
    figure = plot_runs([("a", fake_records(3, 1.0))])
    assert "validation loss" not in [axes.get_title() for axes in figure.axes]


def test_missing_or_empty_metrics_file_is_named(tmp_path):
    with pytest.raises(TorchpreError, match=r"nothing[/\\]metrics\.jsonl does not exist"):
        read_metrics(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    with pytest.raises(TorchpreError, match=r"empty[/\\]metrics\.jsonl is empty"):
        plot_main([str(tmp_path / "empty")])


def test_missing_matplotlib_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(TorchpreError, match=r"torchpre\.plot needs the 'matplotlib' package") as error:
        plot_runs([("a", fake_records(2, 1.0))])
    assert INSTALL_HINT in str(error.value)


@pytest.mark.parametrize(
    "key, module",
    [("enable_wandb", "wandb"), ("enable_tensorboard", "torch.utils.tensorboard")],
)
def test_missing_tracker_package_fails_config_validation(monkeypatch, key, module):
    """Every rank validates the config, so the whole job stops at start, not rank 0 alone mid-setup."""
    monkeypatch.setitem(sys.modules, module, None)
    config = JobConfig()
    setattr(config.metrics, key, True)
    with pytest.raises(TorchpreError, match=f"metrics.{key} needs the '{module}' package") as error:
        validate_config(config)
    assert INSTALL_HINT in str(error.value)


def test_missing_package_stops_the_sinks(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(TorchpreError, match="metrics.enable_wandb"):
        WandbSink(tmp_path, {}, "torchpre", "", "")
    with pytest.raises(TorchpreError, match="metrics.enable_tensorboard"):
        TensorBoardSink(tmp_path, "")
