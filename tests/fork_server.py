"""Runs torchpre's entry points as forked children of one warm interpreter.

Each request gets a fresh process with its own exit code, stdout and stderr, exactly as
`python train.py ...` would give (`run_entry_point`, then Python's own handling of an uncaught
exception or SystemExit), without paying again for Python and torch start-up (2-3 s of CPU per
case on a 2-core CI machine). Requests set environment variables too, so a torchrun worker's
rank can be played: checks that run before the process group see exactly what a worker sees.

A request with "nproc" > 1 forks that many ranks of one job at once, with the RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT (a free port) torchrun would give them; the reply joins their output in rank order and carries the
first non-zero exit code.

A request may carry a "guard" (the fuzzer's, tests/fuzz): {"rlimit_as": bytes of address space the child may hold,
"forbidden": a folder, "audit_log": a file}. The child then runs under RLIMIT_AS, and a Python audit hook appends to
the log one line for every file event (open, rename, remove, mkdir, listdir, ...) whose path resolves under the
forbidden folder, and at exit the child's peak address space ("VmPeak").

Protocol: one JSON request per stdin line, {"entry", "argv", "env" (a null value unsets), "timeout_s",
"nproc" (default 1), "guard" (optional)}; one JSON reply per line on the original stdout, {"returncode", "stdout",
"stderr", "seconds", "timed_out"}.
"""

import gc
import importlib
import json
import os
import pkgutil
import signal
import socket
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
    _preload_transformers()
    import torchpre.convert
    import torchpre.data.prepare
    import torchpre.generate
    import torchpre.plan
    import torchpre.train
    import train
    from tests import count_host_syncs, hf_import_worker, hf_load_memory, reshard_worker, train_and_dump

    return {
        "tests/reshard_worker.py": (reshard_worker.main, "tests/reshard_worker.py"),
        "tests/train_and_dump.py": (train_and_dump.main, "tests/train_and_dump.py"),
        "tests/count_host_syncs.py": (count_host_syncs.main, "tests/count_host_syncs.py"),
        "tests/hf_import_worker.py": (hf_import_worker.main, "tests/hf_import_worker.py"),
        "tests/hf_load_memory.py": (hf_load_memory.main, "tests/hf_load_memory.py"),
        "train.py": (train.main, "train.py"),
        "torchpre.train": (torchpre.train.main, torchpre.train.PROG),
        "torchpre.generate": (torchpre.generate.main, "python -m torchpre.generate"),
        "torchpre.convert": (torchpre.convert.main, torchpre.convert.USAGE),
        "torchpre.data.prepare": (torchpre.data.prepare.main, torchpre.data.prepare.PROG),
        "torchpre.plan": (torchpre.plan.main, torchpre.plan.PROG),
    }


def _preload_transformers() -> None:
    """transformers and its Llama-layout model modules (model.name = 'hf'), which it imports lazily: several
    seconds per child otherwise."""
    try:
        from transformers import AutoModelForCausalLM  # noqa: F401
        from transformers.models.llama import modeling_llama  # noqa: F401
        from transformers.models.qwen2 import modeling_qwen2  # noqa: F401
        from transformers.models.qwen3 import modeling_qwen3  # noqa: F401
    except ImportError:  # the hf extra is not installed: those tests skip
        pass


def _child(main: Callable[[list[str]], None], prog: str, argv: list[str]) -> int:
    """What the interpreter does for `python ENTRY argv`: the entry point, then SystemExit or a traceback."""
    from torchpre.runtime.cli import run_entry_point

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


def _guard(guard: dict | None) -> Callable[[], None]:
    """The fuzzer's bounds on a child (see the module docstring): its address space, and a record of what it touches
    under the forbidden folder; returns what writes the peak address space at the end (the child leaves by
    os._exit, which runs no atexit). The record is written with os.write on a descriptor opened before the hook,
    which raises no audit event of its own."""
    if not guard:
        return lambda: None
    import re
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (guard["rlimit_as"], guard["rlimit_as"]))
    forbidden = os.path.realpath(guard["forbidden"]) + os.sep
    log = os.open(guard["audit_log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def reaches(path: str, follows: bool) -> str:
        """Where an event on `path` lands: through a link at its last component only if the call `follows` it."""
        if follows:
            return os.path.realpath(path)
        return os.path.join(os.path.realpath(os.path.dirname(path) or "."), os.path.basename(path))

    def hook(event: str, args: tuple) -> None:
        if not (event == "open" or event.startswith(("os.", "shutil."))):
            return
        # open follows a link at the name unless O_NOFOLLOW; rename, remove, unlink, symlink, mkdir act on the name
        flags = args[2] if event == "open" and len(args) > 2 and isinstance(args[2], int) else 0
        follows = event == "open" and not flags & getattr(os, "O_NOFOLLOW", 0) or event in ("os.listdir", "os.scandir")
        for arg in args:
            if isinstance(arg, (str, bytes, os.PathLike)):
                path = os.fsdecode(arg)
                if path and reaches(path, follows).startswith(forbidden):
                    os.write(log, f"{event} {path}\n".encode())

    def peak() -> None:
        status = Path("/proc/self/status").read_text() if Path("/proc/self/status").exists() else ""
        found = re.search(r"VmPeak:\s+(\d+) kB", status)
        os.write(log, f"VmPeak {int(found.group(1)) * 1024 if found else 0}\n".encode())

    sys.addaudithook(hook)
    return peak


def _set_env(env: dict[str, str | None]) -> None:
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _rank_env(rank: int, nproc: int, port: int) -> dict[str, str | None]:
    """What torchrun tells rank `rank` of `nproc` on one machine."""
    if nproc == 1:
        return {}
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
    return dict(zip(names, map(str, (rank, rank, nproc, nproc, 0, "127.0.0.1", port))))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _fork(request: dict, entries: dict, protocol_fd: int, env: dict, out: Path, err: Path) -> int:
    main, prog = entries[request["entry"]]
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(protocol_fd)
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            os.dup2(os.open(out, os.O_WRONLY | os.O_CREAT, 0o644), 1)
            os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT, 0o644), 2)
            _set_env({**request.get("env", {}), **env})
            finish = _guard(request.get("guard"))
            code = _child(main, prog, request["argv"])
            finish()
        finally:
            os._exit(code)
    return pid


def _run(request: dict, entries: dict, protocol_fd: int) -> dict:
    nproc = request.get("nproc", 1)
    port = _free_port() if nproc > 1 else 0
    with tempfile.TemporaryDirectory() as folder:
        outs = [(Path(folder, f"stdout{rank}"), Path(folder, f"stderr{rank}")) for rank in range(nproc)]
        start = time.monotonic()
        pids = [
            _fork(request, entries, protocol_fd, _rank_env(rank, nproc, port), *outs[rank]) for rank in range(nproc)
        ]
        deadline = start + request.get("timeout_s", 60)
        statuses: dict[int, int] = {}
        timed_out = False
        while len(statuses) < nproc:
            for pid in pids:
                if pid not in statuses:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        statuses[pid] = status
            if len(statuses) < nproc and time.monotonic() > deadline:
                timed_out = True
                for pid in pids:
                    if pid not in statuses:
                        os.kill(pid, signal.SIGKILL)
                        statuses[pid] = os.waitpid(pid, 0)[1]
            time.sleep(0.02)
        codes = [os.waitstatus_to_exitcode(statuses[pid]) for pid in pids]
        return {
            "returncode": next((code for code in codes if code), 0),
            "stdout": "".join(out.read_text(errors="replace") for out, _ in outs),
            "stderr": "".join(err.read_text(errors="replace") for _, err in outs),
            "seconds": time.monotonic() - start,
            "timed_out": timed_out,
        }


def serve() -> None:
    entries = _entry_points()
    gc.freeze()  # what the server imported is never collected: a child's gc.collect then skips it (0.3 s a child)
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
