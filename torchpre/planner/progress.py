"""A search's progress on stderr: layouts predicted of all, pieces measured, time spent and an estimate of the
rest. On a terminal one line rewritten in place; in a log, a line every `LOG_EVERY_S` seconds."""

import sys
import time
from typing import TextIO

TERMINAL_EVERY_S = 0.5
LOG_EVERY_S = 30.0


class Progress:
    def __init__(self, label: str, total: int, stream: TextIO | None = None) -> None:
        self.label, self.total = label, total
        self.stream = sys.stderr if stream is None else stream
        self.terminal = self.stream.isatty()
        self.start = self._shown = time.perf_counter()
        self._ended = False

    def update(self, done: int, pieces: int) -> None:
        """`done` layouts of `total` predicted, `pieces` distinct pieces measured so far."""
        now = time.perf_counter()
        if self._ended or (now - self._shown < (TERMINAL_EVERY_S if self.terminal else LOG_EVERY_S)
                           and done < self.total):  # fmt: skip
            return
        self._shown, self._ended = now, done >= self.total
        line = self.line(done, pieces, now - self.start)
        self.stream.write(f"\r{line}\033[K" if self.terminal else f"{line}\n")
        self.stream.flush()

    def line(self, done: int, pieces: int, elapsed: float) -> str:
        """The estimate assumes the rest cost what the layouts so far did on average: early layouts measure most
        of the pieces, so it errs long, then shrinks."""
        left = elapsed / done * (self.total - done) if done else float("nan")
        estimate = f", about {_minutes(left)} left" if done and done < self.total else ""
        return (f"{self.label}: {done:,}/{self.total:,} layouts predicted, {pieces:,} pieces measured, "
                f"{_minutes(elapsed)} elapsed{estimate}")  # fmt: skip

    def close(self) -> None:
        if self.terminal:
            self.stream.write("\n")
            self.stream.flush()


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"
