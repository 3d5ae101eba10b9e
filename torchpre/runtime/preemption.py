"""Graceful preemption: turn SIGTERM into a request to stop at the next step boundary.

Clusters announce a preemption with SIGTERM (torchrun forwards it to every worker, then waits its
`--shutdown-timeout`, 30 s by default, before SIGKILL). Dying on it loses the steps since the last
checkpoint; recording it instead lets the loop finish the step, save, and exit cleanly. The flag is
only this rank's wish: the loop folds it into the step's all-reduce (`torchpre.health.verdict.step_verdict`)
so every rank stops after the same step.
"""

import signal
from types import FrameType, TracebackType


class PreemptionHandler:
    """While entered (and `enabled`), SIGTERM sets `requested` instead of ending the process."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.requested = False
        self._previous = signal.SIG_DFL

    def __enter__(self) -> "PreemptionHandler":
        if self.enabled:
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self.enabled:
            signal.signal(signal.SIGTERM, self._previous)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        # No logging here: the handler may interrupt a log call; the loop reports the stop.
        self.requested = True
