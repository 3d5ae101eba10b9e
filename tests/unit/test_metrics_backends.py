"""The metrics sinks and the plot command without training: TensorBoard scalars equal the records (each
step once across a resume), the plot draws one curve per run and metric, readers see one record per
step, and a missing optional package or metrics file is a clear error."""

import json
import sys
from pathlib import Path

import pytest

from torchpre.config.job_config import JobConfig
from torchpre.config.validate import validate_config
from torchpre.errors import TorchpreError
from torchpre.metrics.logger import MetricsLogger
from torchpre.metrics.sinks import JsonlSink, TensorBoardSink, WandbSink, last_logged_step
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


def read_scalars(folder: Path) -> dict[str, dict[int, list[float]]]:
    """Every scalar TensorBoard shows for the run in `folder/tensorboard`: tag -> step -> values (a step
    shown twice would hold two)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    shown: dict[str, dict[int, list[float]]] = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            shown.setdefault(tag, {}).setdefault(event.step, []).append(event.value)
    return shown


def test_a_resumed_tensorboard_sink_shows_redone_steps_once_with_their_new_values(tmp_path):
    """An attempt logs steps 1-5 and stops; the job resumes the checkpoint of step 4 and logs 5-8 again
    with other values (another scale): TensorBoard shows 1-4 of the first attempt, 5-8 of the second."""
    pytest.importorskip("tensorboard")
    first, second = fake_records(5, 1.0), fake_records(8, 3.0)
    sink = TensorBoardSink(tmp_path, "first")
    for record in first:
        sink.log(record)
    sink.close()
    sink = TensorBoardSink(tmp_path, "second", resume_step=4)
    for record in second[4:]:
        sink.log(record)
    sink.close()

    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2
    shown = read_scalars(tmp_path)["loss"]
    assert {step: len(values) for step, values in shown.items()} == {step: 1 for step in range(1, 9)}
    expected = [record["loss"] for record in first[:4] + second[4:]]
    assert [shown[step][0] for step in range(1, 9)] == pytest.approx(expected, rel=TB_TOLERANCE)


def test_read_metrics_keeps_the_last_record_of_each_step_in_step_order(tmp_path):
    """A resumed job appends the steps it redid (4 and 5 here); they replace the interrupted attempt's."""
    first, second = fake_records(5, 1.0), fake_records(7, 2.0)
    write_run(tmp_path / "run", first + second[3:])
    assert read_metrics(tmp_path / "run") == first[:3] + second[3:]
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [second[2], first[0]]))
    assert read_metrics(tmp_path / "run") == [first[0], second[2]]


def test_last_logged_step_is_the_highest_complete_record(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert last_logged_step(path) == 0
    path.write_text("")
    assert last_logged_step(path) == 0
    records = fake_records(5, 1.0) + fake_records(3, 1.0)  # a resume from step 2 that redid step 3
    path.write_text("".join(json.dumps(record) + "\n" for record in records) + '{"step": 9, "lo')  # cut mid-write
    assert last_logged_step(path) == 5
    path.write_text("x" * 2**21 + "\n" + json.dumps(records[1]) + "\n")  # a long file: only the end is read
    assert last_logged_step(path) == 2


def bubble_and_comm_records(steps: int, scale: float, comm: tuple[str, ...]) -> list[dict]:
    """Records with the pipeline bubble, the communication time of the mesh dims `comm`, and the step-time tail."""
    records = []
    for step in range(1, steps + 1):
        record = {"step": step, "loss": scale / step, "pipeline/bubble": 0.2 * scale + 0.01 * step,
                  "pipeline/bubble_max": 0.3 * scale + 0.01 * step, "pipeline/bubble_theory": 0.25 * scale}
        record |= {f"time/comm_{dim}_s": 0.001 * step * scale for dim in comm}
        record |= {f"time/step_{q}_s": 0.1 * scale + 0.001 * i for i, q in enumerate(("p50", "p90", "p99", "max"))}
        records.append(record)
    return records


def test_plot_draws_the_bubble_communication_and_tail_panels_per_run_and_key(tmp_path):
    pytest.importorskip("matplotlib")
    write_run(tmp_path / "pp", bubble_and_comm_records(4, 1.0, ("dp", "pp")))
    write_run(tmp_path / "tp", [{k: v for k, v in r.items() if not k.startswith("pipeline/")}
                                for r in bubble_and_comm_records(3, 2.0, ("tp",))])
    figure = plot_runs([("pp", read_metrics(tmp_path / "pp")), ("tp", read_metrics(tmp_path / "tp"))])
    panels = {axes.get_title(): axes for axes in figure.axes}
    assert list(panels) == ["loss", "pipeline bubble (idle fraction)", "communication time (s per step)",
                            "step time tail (s)"]

    def lines(title: str) -> dict[str, tuple[list, list, str]]:
        return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata()), line.get_linestyle())
                for line in panels[title].get_lines()}

    bubble = lines("pipeline bubble (idle fraction)")
    assert list(bubble) == ["pp: bubble", "pp: bubble_max", "pp: bubble_theory"]
    assert bubble["pp: bubble"][0] == [1, 2, 3, 4]
    assert bubble["pp: bubble"][1] == pytest.approx([0.21, 0.22, 0.23, 0.24])
    assert bubble["pp: bubble_max"][1] == pytest.approx([0.31, 0.32, 0.33, 0.34])
    assert bubble["pp: bubble_theory"][1] == pytest.approx([0.25] * 4)
    assert [style for _, _, style in bubble.values()] == ["-", "-", "--"]  # the theory is dashed

    comm = lines("communication time (s per step)")
    assert list(comm) == ["pp: comm_dp_s", "pp: comm_pp_s", "tp: comm_tp_s"]  # only what each run logged
    assert comm["tp: comm_tp_s"][:2] == ([1, 2, 3], pytest.approx([0.002, 0.004, 0.006]))
    assert comm["pp: comm_pp_s"][1] == pytest.approx([0.001, 0.002, 0.003, 0.004])

    tail = lines("step time tail (s)")
    assert list(tail) == [f"{run}: step_{q}_s" for run in ("pp", "tp") for q in ("p50", "p90", "p99", "max")]
    assert tail["tp: step_p99_s"][:2] == ([1, 2, 3], pytest.approx([0.202] * 3))
    assert [line.get_label() for line in panels["loss"].get_lines()] == ["pp", "tp"]  # one key: the run's name


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
