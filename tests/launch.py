"""Runs train.py in real processes (torchrun for several, or forks of a warm interpreter) and reads back
what it wrote; spawns gloo workers for in-process multi-rank tests."""

import atexit
import contextlib
import dataclasses
import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
import zlib
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Literal

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchpre.checkpoint.integrity import MANIFEST, FileCheck, write_manifest
from torchpre.checkpoint.reader import Loader
from torchpre.checkpoint.values import read_values

REPO = Path(__file__).resolve().parents[1]

# transformers (its Llama) for the spawned tests of transformers models; the fork server skips what it cannot import.
multiprocessing.set_forkserver_preload(
    ["torch", "torch.distributed", "tests.launch", "transformers.models.llama.modeling_llama"]
)

# What every launched job gets on top of the caller's environment: two processes share two cores.
WORKER_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
# The entry points tests/fork_server.py can run.
FORKABLE = (
    "train.py", "tests/train_and_dump.py", "tests/count_host_syncs.py", "tests/hf_import_worker.py",
    "tests/hf_load_memory.py", "torchpre.generate", "torchpre.convert",
)  # fmt: skip

# The debug model (6 layers, so up to 4 pipeline stages) on short sequences: the layout tests' model.
DEBUG = [
    "--model.flavor",
    "debugmodel",
    "--training.seq_len",
    "32",
    "--lr_scheduler.warmup_steps",
    "2",
    "--metrics.log_freq",
    "1",
]

# The tiny MoE model: 2 microbatches of 2 sequences per rank at dp2 (global batch 8).
MOE_TINY = [
    "--model.name", "moe",
    "--model.flavor", "tiny",
    "--training.seq_len", "32",
    "--training.local_batch_size", "2",
    "--training.global_batch_size", "8",
]  # fmt: skip

# A model small enough that a 2-core machine trains it in seconds, big enough to exercise GQA.
TINY = [
    "--model.flavor",
    "tiny",
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "4",
    "--lr_scheduler.warmup_steps",
    "2",
    "--metrics.log_freq",
    "1",
]


def short_documents_args(folder: Path, documents: int = 2000) -> list[str]:
    """Training args for a .jsonl dataset whose documents are the first `documents` lines of the built-in corpus
    (~5-20 tokens each, where its documents are longer than a 32-token window): every window holds several
    documents, so training.document_mask changes the loss."""
    from torchpre.data.corpus import stdlib_documents

    lines = [line.strip() for doc in stdlib_documents() for line in doc.splitlines() if line.strip()]
    path = folder / "lines.jsonl"
    path.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines[:documents]))
    return ["--training.dataset", "text", "--training.dataset_path", str(path)]


def manifest_record(path: Path) -> dict[str, int]:
    """A file's entry in a checkpoint's manifest.json, as a save writes it: its size and zlib's CRC-32."""
    return {"size": path.stat().st_size, "crc32": zlib.crc32(path.read_bytes())}


def read_checkpoint(step_dir: Path) -> dict:
    """All a step folder holds, nested by component: DCP's entries read whole through torchpre's safe reader, and
    the plain values of its state.json."""
    check = FileCheck(step_dir)
    state = Loader(check).load_whole()
    for name, value in (read_values(check) or {}).items():
        component, key = name.split(".", 1)
        state.setdefault(component, {})[key] = value
    return state


def add_manifest(step_dir: Path) -> Path:
    """Gives a step folder written by plain `dcp.save` the manifest a torchpre save writes, so that it loads without
    checkpoint.allow_unverified; returns the folder."""
    files = {path.name: manifest_record(path) for path in step_dir.iterdir() if path.name != MANIFEST}
    write_manifest(step_dir, "write", files)
    return step_dir


def run_entry(
    entry: str,
    argv: list[str],
    nproc: int = 1,
    timeout: float = 600,
    launcher: Literal["fork", "torchrun"] = "fork",
) -> subprocess.CompletedProcess:
    """`python entry argv` (`python -m entry` for a module) as one process, or as `nproc` ranks of one job.

    The entries tests/fork_server.py knows run as forks of a warm interpreter, with the environment torchrun
    would give each rank: that saves Python's and torch's start-up per rank, the bulk of a short test job on 2
    cores. `launcher="torchrun"` runs the real torchrun (or python), for tests of what torchrun adds (its exit
    codes and summary, restarts, signals); other scripts always do. Never hangs past `timeout`.
    """
    if launcher == "fork" and entry in FORKABLE:
        return _fork_server().run_completed(entry, argv, timeout, nproc)
    torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else []
    target = ["-m", entry] if entry.startswith("torchpre.") else [entry]
    return subprocess.run(
        [sys.executable, *torchrun, *target, *argv],
        cwd=REPO,
        env={**os.environ, **WORKER_ENV},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_train(
    args: list[str],
    nproc: int,
    dump_folder: Path,
    timeout: float = 600,
    script: str = "train.py",
    launcher: Literal["fork", "torchrun"] = "fork",
) -> subprocess.CompletedProcess:
    """`script` (train.py or one like it) writing into `dump_folder`; see `run_entry`.

    A job with a rank that glibc aborted on a corrupted heap runs once more from the folder as it was before
    (with a warning pytest lists): torch 2.14's gloo corrupts its heap under functional collectives now and then
    (docs/testing.md, "Heap aborts under gloo"). A second abort, or any other failure, is the test's result."""
    argv = ["--job.dump_folder", str(dump_folder), *args]
    with _folder_kept(dump_folder) as restore:
        result = run_entry(script, argv, nproc, timeout, launcher)
        if result.returncode != 0 and (message := heap_abort(result.stdout + result.stderr)):
            warnings.warn(f"a rank of {script} {' '.join(args)} aborted on {message!r}; ran it again", stacklevel=2)
            restore()
            result = run_entry(script, argv, nproc, timeout, launcher)
    return result


# What glibc prints before it aborts a process whose heap it found corrupted (malloc/malloc.c's checks).
HEAP_ABORTS = re.compile(
    r"^(?:malloc\(\)|free\(\)|realloc\(\)|malloc_consolidate\(\)|munmap_chunk\(\)|double free or corruption"
    r"|corrupted (?:size vs\. prev_size|double-linked list))[^\n]*",
    re.MULTILINE,
)


def heap_abort(output: str) -> str | None:
    """glibc's message for a heap it found corrupted, if the output holds one."""
    found = HEAP_ABORTS.search(output)
    return found.group(0) if found else None


@contextlib.contextmanager
def _folder_kept(folder: Path) -> Iterator[Callable[[], None]]:
    """Yields a function that puts `folder` back as it was on entry (absent, or a copy of it: the checkpoints a
    resume test placed there)."""
    with tempfile.TemporaryDirectory(prefix="kept-") as keep:
        copy = Path(keep) / "folder"
        if folder.exists():
            shutil.copytree(folder, copy, symlinks=True)

        def restore() -> None:
            shutil.rmtree(folder, ignore_errors=True)
            if copy.exists():
                shutil.copytree(copy, folder, symlinks=True)

        yield restore


def train_and_read_metrics(
    args: list[str],
    nproc: int,
    dump_folder: Path,
    script: str = "train.py",
    launcher: Literal["fork", "torchrun"] = "fork",
) -> list[dict]:
    """Trains and returns the records of metrics.jsonl; fails the test with the job's output if it fails."""
    result = run_train(args, nproc, dump_folder, script=script, launcher=launcher)
    assert result.returncode == 0, f"training failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    lines = (dump_folder / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]



def assert_trained(records: list[dict]) -> None:
    """The weights moved: every logged step had a non-zero gradient and some step a positive learning rate (AdamW then
    moves every parameter with a gradient). A later step's lower loss is no evidence over a few steps: each step trains
    on other samples, which the sample order chooses."""
    assert all(record["grad_norm"] > 0 for record in records), [record["grad_norm"] for record in records]
    assert max(record["lr"] for record in records) > 0, [record["lr"] for record in records]

def train_and_read_params(args: list[str], nproc: int, dump_folder: Path) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Trains with tests/train_and_dump.py; returns the metrics and the final parameters by name
    (pipeline stages merged; a weight held by two stages must agree)."""
    result = run_train(args, nproc, dump_folder, script="tests/train_and_dump.py")
    assert result.returncode == 0, f"training failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    params: dict[str, torch.Tensor] = {}
    for path in sorted(dump_folder.glob("params_rank*.pt")):
        for name, value in torch.load(path).items():
            if name in params:
                torch.testing.assert_close(value, params[name], rtol=0, atol=0, msg=f"{name} differs between ranks")
            params[name] = value
    records = [json.loads(line) for line in (dump_folder / "metrics.jsonl").read_text().splitlines()]
    return records, params


def spawn(fn: Callable[[DeviceMesh], None], world_size: int, store_path: Path, timeout_s: float = 480) -> None:
    """Runs `fn(mesh)` on `world_size` gloo processes; a worker's exception or a hang fails.

    The workers are forked from multiprocessing's fork server, which imported torch once (and never ran an op, so
    no thread pool is forked): a fresh process as "spawn" gives, without paying torch's import per worker.

    The processes rendezvous through a FileStore, as PyTorch's own distributed tests do: no port
    to race for, and no store server living in rank 0 that may exit while rank 1 tears down.
    """
    context = mp.start_processes(
        _worker,
        args=(fn, world_size, str(store_path), dict(os.environ)),
        nprocs=world_size,
        join=False,
        start_method="forkserver",
    )
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(deadline - time.monotonic(), 0)):
        if time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{fn.__name__} did not finish within {timeout_s} s on {world_size} processes")


def _worker(rank: int, fn: Callable[[DeviceMesh], None], world_size: int, store_path: str, env: dict) -> None:
    os.environ.clear()  # the caller's environment now, not the fork server's from when it started
    os.environ.update(env)
    torch.set_num_threads(1)  # two processes on two cores
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    fn(init_device_mesh("cpu", (world_size,)))
    dist.barrier()  # without it gloo intermittently aborts at exit (see cpu-notes)
    dist.destroy_process_group()


@dataclasses.dataclass(frozen=True)
class ForkResult:
    returncode: int
    stdout: str
    stderr: str
    seconds: float


class ForkServer:
    """Talks to tests/fork_server.py, which runs each request as fresh processes forked from one warm
    interpreter: no Python and torch start-up per launch. `startup_s` (that start-up, paid once) is added to
    each result's time; a request running past `timeout_s` fails the test."""

    def __init__(self, log: Path, timeout_s: float = 60):
        start = time.monotonic()
        env = {**os.environ, **WORKER_ENV}
        self._env = env
        self.timeout_s = timeout_s
        self._log = log.open("w")
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tests.fork_server"],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        assert json.loads(self._process.stdout.readline() or "{}").get("ready"), log.read_text()
        self.startup_s = time.monotonic() - start

    def run(
        self,
        entry: str,
        argv: list[str],
        env: dict[str, str | None] | None = None,
        nproc: int = 1,
        timeout_s: float | None = None,
    ) -> ForkResult:
        """`entry` with `argv`, as `nproc` ranks of one job (as torchrun would start them) when nproc > 1."""
        timeout_s = timeout_s or self.timeout_s
        request = {"entry": entry, "argv": argv, "env": env or {}, "timeout_s": timeout_s, "nproc": nproc}
        reply = self.request(request)
        assert not reply["timed_out"], f"{entry} {argv} ran past {timeout_s} s:\n{reply['stderr'][-3000:]}"
        return ForkResult(reply["returncode"], reply["stdout"], reply["stderr"], reply["seconds"] + self.startup_s)

    def request(self, request: dict) -> dict:
        """The server's reply to one request of its protocol (tests/fork_server.py), as it is."""
        self._process.stdin.write(json.dumps(request) + "\n")
        self._process.stdin.flush()
        return json.loads(self._process.stdout.readline())

    def run_completed(self, entry: str, argv: list[str], timeout_s: float, nproc: int) -> subprocess.CompletedProcess:
        """`run` with the caller's current environment (as a new process would inherit it), answered the way
        `subprocess.run` answers."""
        current = {**os.environ, **WORKER_ENV}
        env: dict[str, str | None] = {name: None for name in self._env if name not in current}
        env.update({name: value for name, value in current.items() if self._env.get(name) != value})
        result = self.run(entry, argv, env=env, nproc=nproc, timeout_s=timeout_s)
        return subprocess.CompletedProcess([entry, *argv], result.returncode, result.stdout, result.stderr)

    def close(self) -> None:
        self._process.stdin.close()
        self._process.wait(timeout=30)
        self._log.close()


_SERVER: ForkServer | None = None


def _fork_server() -> ForkServer:
    """This test process's fork server, started on first use and closed at exit."""
    global _SERVER
    if _SERVER is None:
        _SERVER = ForkServer(Path(tempfile.mkdtemp(prefix="torchpre_fork_server_")) / "server.log")
        atexit.register(_SERVER.close)
    return _SERVER
