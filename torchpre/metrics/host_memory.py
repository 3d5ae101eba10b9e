"""This process's resident memory (RSS) now and its peak since a point in time, from Linux's /proc/self.

`reset_peak_rss()` sets the kernel's high-water mark of the process to its current RSS (writing 5 to
/proc/self/clear_refs), so `peak_rss_bytes()` afterwards is the peak since then: how much one phase (loading a
model) needed, whatever came before. The process's lifetime peak (`getrusage`, which the training metrics report
as max_memory_bytes on CPU) then counts from the reset too. Without /proc (not Linux) the peak is the lifetime one.
"""

import resource
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def rss_bytes() -> int:
    """The resident set size now (VmRSS); the lifetime peak where /proc is not available."""
    return _status_bytes("VmRSS")


def peak_rss_bytes() -> int:
    """The resident set size's high-water mark (VmHWM): since the last `reset_peak_rss`, or the process start."""
    return _status_bytes("VmHWM")


def reset_peak_rss() -> None:
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:  # not Linux, or /proc read-only: the peak stays the lifetime one
        pass


def _status_bytes(field: str) -> int:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024  # in kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
