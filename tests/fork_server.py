"""Runs torchpre's entry points as forked children of one warm interpreter.

Each request gets a fresh process with its own exit code, stdout and stderr, exactly as
`python train.py ...` would give (`run_entry_point`, then Python's own handling of an uncaught
exception or SystemExit), without paying again for Python and torch start-up (2-3 s of CPU per
case on a 2-core CI machine). Requests set environment variables too, so a torchrun worker's
rank can be played: checks that run before the process group see exactly what a worker sees.

Protocol: one JSON request per stdin line, {"entry", "argv", "env" (a null value unsets), "timeout_s"};
one JSON reply per line on the original stdout, {"returncode", "stdout", "stderr", "seconds", "timed_out"}.
"""

import importlib
import json
import os
import pkgutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch  # noqa: F401  (imported once here, before any fork)

REPO = Path(__file__).resolve().parents[1]


def _entry_points() -> dict[str, tuple[Callable[[list[str]], None], str]]:
    """Entry name -> (main, prog); importing them, and every module they may import lazily, up front is
    what makes each fork cheap."""
    sys.path.insert(0, str(REPO))
    import torchpre

    for module in pkgutil.walk_packages(torchpre.__path__, "torchpre."):
        try:
            importlib.import_module(module.name)
        except Exception:  # an optional dependency (a tracker, plotting) is missing: a child imports what it needs
            pass
    import torchpre.convert
    import torchpre.data.prepare
    import torchpre.generate
    import torchpre.trainer  # noqa: F401  (train.py imports it inside main)
    import train

    return {
        "train.py": (train.main, "train.py"),
        "torchpre.generate": (torchpre.generate.main, "python -m torchpre.generate"),
        "torchpre.convert": (torchpre.convert.main, torchpre.convert.USAGE),
        "torchpre.data.prepare": (torchpre.data.prepare.main, torchpre.data.prepare.PROG),
    }


def _child(main: Callable[[list[str]], None], prog: str, argv: list[str]) -> int:
    """What the interpreter does for `python ENTRY argv`: the entry point, then SystemExit or a traceback."""
    from torchpre.cli import run_entry_point

    sys.argv = [prog, *argv]
    try:
        run_entry_point(main, argv, prog)
        return 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _set_env(env: dict[str, str | None]) -> None:
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _run(request: dict, entries: dict, protocol_fd: int) -> dict:
    main, prog = entries[request["entry"]]
    with tempfile.TemporaryDirectory() as folder:
        out, err = Path(folder, "stdout"), Path(folder, "stderr")
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(protocol_fd)
                os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
                os.dup2(os.open(out, os.O_WRONLY | os.O_CREAT, 0o644), 1)
                os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT, 0o644), 2)
                _set_env(request.get("env", {}))
                code = _child(main, prog, request["argv"])
            finally:
                os._exit(code)
        deadline = start + request.get("timeout_s", 60)
        timed_out = False
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                _, status = os.waitpid(pid, 0)
                timed_out = True
                break
            time.sleep(0.02)
        return {
            "returncode": os.waitstatus_to_exitcode(status),
            "stdout": out.read_text(errors="replace"),
            "stderr": err.read_text(errors="replace"),
            "seconds": time.monotonic() - start,
            "timed_out": timed_out,
        }


def serve() -> None:
    entries = _entry_points()
    protocol_fd = os.dup(1)
    os.dup2(2, 1)  # stray prints of the server itself must not corrupt the replies
    with os.fdopen(protocol_fd, "w") as replies:
        replies.write(json.dumps({"ready": True}) + "\n")
        replies.flush()
        for line in sys.stdin:
            replies.write(json.dumps(_run(json.loads(line), entries, protocol_fd)) + "\n")
            replies.flush()


if __name__ == "__main__":
    serve()
