"""Moving an earlier run's files aside: later checkpoints and an old metrics.jsonl, never overwritten."""

from torchpre.checkpoint.history import set_aside_later_steps, start_new_metrics_file


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


def test_an_old_metrics_file_gets_the_next_free_number(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert start_new_metrics_file(path) is None
    path.write_text("")
    assert start_new_metrics_file(path) is None  # empty: nothing to keep
    for number in (1, 2):
        path.write_text(f'{{"run": {number}}}\n')
        assert start_new_metrics_file(path) == tmp_path / f"metrics.{number}.jsonl"
    assert not path.exists()
    assert (tmp_path / "metrics.1.jsonl").read_text() == '{"run": 1}\n'
