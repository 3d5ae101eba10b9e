"""The planner's progress line: layouts predicted of all, pieces measured, time spent, the rest estimated."""

import io

from torchpre.planner import progress as progress_module
from torchpre.planner.progress import Progress


def test_the_line_estimates_the_rest_at_the_average_so_far():
    progress = Progress("planner", 200, stream=io.StringIO())
    # 50 layouts in 30 s: the other 150 at 0.6 s each, 90 s
    line = progress.line(50, 7, 30.0)
    assert line == "planner: 50/200 layouts predicted, 7 pieces measured, 0:30 elapsed, about 1:30 left"
    assert progress.line(200, 9, 75.0) == "planner: 200/200 layouts predicted, 9 pieces measured, 1:15 elapsed"


def test_a_log_gets_a_line_every_30_seconds_and_one_at_the_end(monkeypatch):
    """Not a terminal (a log, a pipe): a line when 30 s have passed since the last one, and when the last layout is
    predicted (once, though the forked workers' last report and the search's both say so); nothing in between."""
    clock = [100.0]
    monkeypatch.setattr(progress_module.time, "perf_counter", lambda: clock[0])
    stream = io.StringIO()
    progress = Progress("planner", 4, stream=stream)
    for now, done in ((110.0, 1), (131.0, 2), (150.0, 3), (155.0, 4), (156.0, 4)):
        clock[0] = now
        progress.update(done, done + 1)
    progress.close()
    assert stream.getvalue().splitlines() == [
        "planner: 2/4 layouts predicted, 3 pieces measured, 0:31 elapsed, about 0:31 left",
        "planner: 4/4 layouts predicted, 5 pieces measured, 0:55 elapsed",
    ]
