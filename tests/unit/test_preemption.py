"""The stop signals (SIGTERM, SIGUSR1) become a request instead of ending the process, and the note a launcher asks
for (TORCHPRE_STOP_FILE) names the step a signal stopped the job after."""

import os
import signal

import pytest

from torchpre.runtime.preemption import PreemptionHandler, leave_stop_note


@pytest.mark.parametrize("first, then", [(signal.SIGUSR1, signal.SIGTERM), (signal.SIGTERM, signal.SIGUSR1)])
def test_either_stop_signal_is_recorded_by_name_and_the_previous_handlers_come_back(first, then):
    outside = []  # signals that reached the handlers in place before (not the process's death: a test must report)

    def record(signum, frame):
        outside.append(signum)

    previous = {sig: signal.signal(sig, record) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        with PreemptionHandler(enabled=True) as handler:
            assert not handler.requested
            os.kill(os.getpid(), first)
            os.kill(os.getpid(), then)
        assert outside == []
        assert handler.requested
        assert handler.received == first.name  # the first one
        assert signal.getsignal(signal.SIGTERM) is record and signal.getsignal(signal.SIGUSR1) is record
    finally:
        for sig, handler_before in previous.items():
            signal.signal(sig, handler_before)


def test_a_disabled_handler_leaves_the_signals_alone():
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    with PreemptionHandler(enabled=False) as handler:
        assert {sig: signal.getsignal(sig) for sig in previous} == previous
    assert not handler.requested


@pytest.mark.parametrize("local_rank, written", [("0", True), ("1", False), (None, True)])
def test_the_stop_note_is_written_once_per_node_where_the_launcher_asked(tmp_path, monkeypatch, local_rank, written):
    note = tmp_path / "stop"
    monkeypatch.setenv("TORCHPRE_STOP_FILE", str(note))
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)  # one process without torchrun
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    leave_stop_note(12)
    assert (note.read_text() if note.exists() else None) == ("12\n" if written else None)


def test_no_note_unless_asked(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHPRE_STOP_FILE", raising=False)
    monkeypatch.chdir(tmp_path)
    leave_stop_note(12)
    assert not list(tmp_path.iterdir())
