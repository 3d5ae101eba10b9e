"""Moving an earlier run's files aside: later checkpoints and an old run's metrics, never overwritten."""

from torchpre.checkpoint.history import set_aside_earlier_metrics, set_aside_later_steps


def make_steps(folder, *steps):
    for step in steps:
        (folder / f"step-{step}").mkdir(parents=True)
        (folder / f"step-{step}" / "marker").write_text(str(step))


def test_later_steps_move_to_a_fresh_folder_each_time(tmp_path):
    make_steps(tmp_path, 50, 100, 120, 150)
    (tmp_path / ".tmp-step-200").mkdir()  # unfinished saves are not checkpoints: left for the cleanup
    first = set_aside_later_steps(tmp_path, 100)
    assert first == tmp_path / "superseded-from-step-100"
    assert sorted(p.name for p in first.iterdir()) == ["step-120", "step-150"]
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-100", "step-50"]
    make_steps(tmp_path, 120)
    second = set_aside_later_steps(tmp_path, 100)
    assert second == tmp_path / "superseded-from-step-100-2"
    assert (second / "step-120" / "marker").read_text() == "120"
    assert set_aside_later_steps(tmp_path, 100) is None  # nothing later: nothing moves


def test_an_old_runs_metrics_get_the_next_number_free_for_all(tmp_path):
    path, events, run_id = tmp_path / "metrics.jsonl", tmp_path / "tensorboard", tmp_path / "wandb" / "run_id"
    assert set_aside_earlier_metrics(tmp_path) == []
    path.write_text("")
    events.mkdir()
    assert set_aside_earlier_metrics(tmp_path) == []  # empty: nothing to keep
    path.write_text('{"run": 1}\n')
    assert set_aside_earlier_metrics(tmp_path) == [tmp_path / "metrics.1.jsonl"]
    path.write_text('{"run": 2}\n')
    (events / "events.out.tfevents.2").write_text("2")
    run_id.parent.mkdir()
    run_id.write_text("abc")
    moved = [tmp_path / "metrics.2.jsonl", tmp_path / "tensorboard.2", tmp_path / "wandb" / "run_id.2"]
    assert set_aside_earlier_metrics(tmp_path) == moved
    (events := tmp_path / "tensorboard").mkdir()
    (events / "events.out.tfevents.3").write_text("3")
    assert set_aside_earlier_metrics(tmp_path) == [tmp_path / "tensorboard.3"]  # 1 and 2 are taken
    assert not path.exists() and not events.exists() and not run_id.exists()
    assert (tmp_path / "metrics.1.jsonl").read_text() == '{"run": 1}\n'
    assert (tmp_path / "tensorboard.2" / "events.out.tfevents.2").read_text() == "2"
    assert (tmp_path / "wandb" / "run_id.2").read_text() == "abc"
