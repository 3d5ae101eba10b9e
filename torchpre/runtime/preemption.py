"""Graceful preemption: turn SIGTERM or SIGUSR1 into a request to stop at the next step boundary.

Clusters announce a preemption with SIGTERM (torchrun forwards it to every worker, then waits its
`--shutdown-timeout`, 30 s by default, before SIGKILL). multinode.slurm passes Slurm's warning before a time limit
or a preemption on as SIGUSR1, which its torchrun ignores so that it ends as its workers do. Dying on either loses
the steps since the last checkpoint; recording it instead lets the loop finish the step, save, and exit cleanly.
The flag is only this rank's wish: the loop folds it into the step's all-reduce
(`torchpre.health.verdict.step_verdict`) so every rank stops after the same step.
"""

import os
import signal
from pathlib import Path
from types import FrameType, TracebackType

from torchpre.confined import write_file

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# A launcher that must tell a job stopped by a signal from one that ran its last step names a file here.
STOP_FILE_VARIABLE = "TORCHPRE_STOP_FILE"


class PreemptionHandler:
    """While entered (and `enabled`), SIGTERM and SIGUSR1 set `received` instead of ending the process."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.received: str | None = None  # the name of the first stop signal this process got
        self._previous: dict[signal.Signals, signal.Handlers] = {}

    @property
    def requested(self) -> bool:
        return self.received is not None

    def __enter__(self) -> "PreemptionHandler":
        if self.enabled:
            self._previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # No logging here: the handler may interrupt a log call; the loop reports the stop.
        if self.received is None:
            self.received = signal.Signals(signum).name


def leave_stop_note(step: int) -> None:
    """Writes `step`, the step the job stopped after on a stop signal, to the file named by TORCHPRE_STOP_FILE when
    the launcher set it (multinode.slurm, on its own node: it requeues the job only then). One process per node
    writes it, the one with LOCAL_RANK 0; a job that ran its last step writes nothing. The file is written new and
    renamed into place: a symbolic link at its name is replaced, never written through."""
    path = os.environ.get(STOP_FILE_VARIABLE)
    if path and os.environ.get("LOCAL_RANK", "0") == "0":
        write_file(Path(path), f"{step}\n")
