"""Runs fuzz cases and checks each against the invariant (tests/fuzz/__init__.py).

    python -m tests.fuzz.run --cases 20000 [--seed S] [--workers 2] [--keep DIR]   # the full run (-m fuzz)
    python -m tests.fuzz.run --seed S --case I --keep DIR                             # one case again, kept

A case is a function of (seed, index): its load path, targets and mutations come from `random.Random(f"{seed}:{i}")`,
so a failure is reproduced by its seed and index alone.
"""

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import struct
import sys
import tempfile
import time
import zlib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.fuzz import formats
from tests.fuzz.genuine import Genuine, build
from tests.fuzz.paths import LOAD_PATHS, LoadPath, Target, choose, mutator
from tests.launch import ForkServer

# The address space a case may hold beyond the warm interpreter it is forked from (RLIMIT_AS): a tiny model's run
# needs a few hundred MB; a file that makes a reader allocate what it declares (the reviewer's 2.7 GB) does not fit.
ADDRESS_SPACE_BOUND = 2 << 30
MANIFEST = "manifest.json"


@dataclass
class Outcome:
    seed: str
    index: int
    load_path: str
    mutations: list[formats.Mutation]
    returncode: int = 0
    seconds: float = 0.0
    failure: str | None = None
    kind: str = ""  # "same", "changed" (a value moved in its range), "refused"

    def describe(self) -> str:
        done = "; ".join(f"{m.target}: {m.what}" for m in self.mutations)
        return f"case {self.seed}:{self.index} [{self.load_path}] {done} -> exit {self.returncode}: {self.failure}"


@dataclass
class Report:
    outcomes: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0
    peak_address_space: int = 0

    @property
    def failures(self) -> list[Outcome]:
        return [outcome for outcome in self.outcomes if outcome.failure]

    def summary(self) -> str:
        kinds = Counter(outcome.kind for outcome in self.outcomes if not outcome.failure)
        paths = Counter(outcome.load_path for outcome in self.outcomes)
        lines = [
            f"{len(self.outcomes)} cases in {self.seconds:.0f} s: {len(self.failures)} failed; "
            f"{kinds['refused']} refused (exit 2 naming a file), {kinds['same']} loaded with the genuine result, "
            f"{kinds['changed']} loaded a value changed within its range",
            "by load path: " + ", ".join(f"{name} {count}" for name, count in sorted(paths.items())),
        ]
        return "\n".join(lines + [outcome.describe() for outcome in self.failures[:50]])


class Fuzzer:
    """Runs cases in `root` through one fork server; the genuine inputs are built once (`genuine`)."""

    def __init__(self, root: Path, server: ForkServer, genuine: Genuine) -> None:
        self.root, self.server, self.genuine = root, server, genuine
        self.rlimit = _address_space(server) + ADDRESS_SPACE_BOUND
        self.baselines: dict[str, Any] = {}

    def baseline(self, path: LoadPath) -> Any:
        """The load path's result on the genuine inputs (each load path's, once)."""
        if path.name not in self.baselines:
            outcome = Outcome("genuine", 0, path.name, [])
            case = self._prepare(f"genuine-{path.name}", path)
            reply = self._run(case, path, outcome)
            assert reply["returncode"] == 0, f"{path.name} fails on the genuine inputs:\n{reply['stderr'][-3000:]}"
            self.baselines[path.name] = path.result(case / "in", case / "out", reply)
            shutil.rmtree(case)
        return self.baselines[path.name]

    def run_case(self, seed: str, index: int, keep: Path | None = None, keep_all: bool = False) -> Outcome:
        rng = random.Random(f"{seed}:{index}")
        path = choose(rng)
        expected = self.baseline(path)
        outcome = Outcome(seed, index, path.name, [])
        case = self._prepare(f"case-{index}", path)
        for _ in range(rng.choice([1, 1, 1, 2, 3])):
            outcome.mutations.append(self._mutate(case, path, rng.choice(path.targets(case / "in")), rng))
        if rng.random() < 0.75:  # an attacker recomputes the manifest; else it is stale
            _rewrite_manifests(case / "in")
        victims = _digests(case / "outside")
        reply = self._run(case, path, outcome)
        outcome.failure = self._check(case, path, reply, outcome, expected, victims)
        if keep is not None and (outcome.failure or keep_all):
            shutil.copytree(case, keep / f"case-{seed}-{index}", symlinks=True, dirs_exist_ok=True)
        shutil.rmtree(case, ignore_errors=True)
        return outcome

    def _prepare(self, name: str, path: LoadPath) -> Path:
        case = self.root / name
        shutil.rmtree(case, ignore_errors=True)
        for folder, target in (("in", path.copies), ("outside", path.decoys)):
            for copy, source in target.items():
                shutil.copytree(self.genuine.folder(source), case / folder / copy, symlinks=True)
        (case / "outside").mkdir(parents=True, exist_ok=True)
        (case / "outside" / "victim.txt").write_text("the victim's file\n")
        (case / "out").mkdir()
        return case

    def _mutate(self, case: Path, path: LoadPath, target: Target, rng: random.Random) -> formats.Mutation:
        entry = case / "in" / target.path
        file_system = rng.random() < (0.25 if target.format != "entry" else 1.0)
        if file_system or not entry.is_file() or entry.is_symlink():
            decoy = case / "outside" / target.decoy if target.decoy else None
            victim = case / "outside" / "victim.txt"
            what, may_change = formats.replace_entry(entry, rng, decoy, victim, target.path in path.named)
            if path.name == "resume-latest" and entry.name == "step-2" and what in ("remove", "folder"):
                may_change = True  # no checkpoint to resume: -1 starts afresh, as documented
        else:
            try:
                what, may_change = mutator(target.format, case, self.genuine)(entry, rng)
            except (ValueError, IndexError, KeyError, TypeError, RecursionError, struct.error):
                # an earlier mutation broke the file's form: its bytes then
                what, may_change = formats.binary(may_change=False)(entry, rng)
        return formats.Mutation(target.path, what, may_change)

    def _run(self, case: Path, path: LoadPath, outcome: Outcome) -> dict:
        entry, argv = path.command(case / "in", case / "out", self.genuine)
        guard = {"rlimit_as": self.rlimit, "forbidden": str(case / "outside"), "audit_log": str(case / "audit.log")}
        request = {"entry": entry, "argv": argv, "env": {}, "timeout_s": path.timeout_s, "guard": guard,
                   "nproc": path.nproc}  # fmt: skip
        reply = self.server.request(request)
        outcome.returncode, outcome.seconds = reply["returncode"], reply["seconds"]
        return reply

    def _check(
        self, case: Path, path: LoadPath, reply: dict, outcome: Outcome, expected: Any, victims: dict[str, str]
    ) -> str | None:
        audit = (case / "audit.log").read_text().splitlines() if (case / "audit.log").exists() else []
        touched = [line for line in audit if not line.startswith("VmPeak")]
        if touched:
            return f"touched a file outside the case's inputs: {touched[:3]}"
        if _digests(case / "outside") != victims:
            return "changed a file outside the case's inputs"
        if reply["timed_out"]:
            return f"ran past {path.timeout_s} s"
        stderr = reply["stderr"]
        if "Traceback" in stderr:
            return "a traceback: " + " | ".join(stderr.strip().splitlines()[-3:])[-600:]
        if reply["returncode"] == 2:
            if str(case / "in") not in stderr and str(case / "out") not in stderr:
                return "exit 2 without naming a file of the case: " + stderr.strip()[-400:]
            silent = [rank for rank in range(path.nproc) if f"error (rank {rank})" not in stderr]
            if silent:
                return f"exit 2, but rank(s) {silent} gave no message: " + stderr.strip()[-400:]
            outcome.kind = "refused"
            return None
        if reply["returncode"] != 0:
            return f"exit {reply['returncode']}: " + stderr.strip()[-400:]
        try:
            result = path.result(case / "in", case / "out", reply)
        except Exception as error:  # the command said it succeeded
            return f"exit 0 without a result ({type(error).__name__}: {error})"
        if result == expected:
            outcome.kind = "same"
            return None
        if any(mutation.may_change for mutation in outcome.mutations):
            outcome.kind = "changed"
            return None
        return f"exit 0 with another result than the genuine input's: {_short(result)} != {_short(expected)}"


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) < 200 else text[:200] + "..."


def _address_space(server: ForkServer) -> int:
    status = Path(f"/proc/{server._process.pid}/status").read_text()
    return int(re.search(r"VmSize:\s+(\d+) kB", status).group(1)) * 1024


def _digests(folder: Path) -> dict[str, str]:
    """Every regular file under `folder` (links not followed) and what it holds."""
    found = {}
    for directory, _, names in os.walk(folder):
        for name in names:
            path = Path(directory, name)
            if path.is_file() and not path.is_symlink():
                found[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def _rewrite_manifests(folder: Path) -> None:
    """What an attacker does after altering a checkpoint: each manifest's records recomputed from the files, where
    they are still regular files and the manifest still parses (the signature cannot be: no key)."""
    for manifest in folder.rglob(MANIFEST):
        if manifest.is_symlink() or not manifest.is_file() or manifest.parent.name.startswith("shards"):
            continue
        try:
            record = json.loads(manifest.read_text())
            files = record["files"]
            for name in list(files):
                path = manifest.parent / name
                if isinstance(files[name], dict) and path.is_file() and not path.is_symlink():
                    data = path.read_bytes()
                    files[name] = files[name] | {"size": len(data), "crc32": zlib.crc32(data)}
                    if "sha256" in files[name]:
                        files[name]["sha256"] = hashlib.sha256(data).hexdigest()
            manifest.write_text(json.dumps(record))
        except Exception:  # a manifest an earlier mutation broke (deep, not UTF-8, no records): left as it is
            continue


def fuzz(cases: int, seed: str, root: Path, workers: int = 1, keep: Path | None = None,
         progress: bool = False) -> Report:  # fmt: skip
    """`cases` cases of `seed` (indices 0..cases-1) on `workers` fork servers; the genuine inputs built in `root`."""
    start = time.monotonic()
    servers = [ForkServer(root / f"server-{worker}.log", timeout_s=120) for worker in range(workers)]
    try:
        genuine = build(root / "genuine", servers[0])
        fuzzers = [Fuzzer(root / f"worker-{worker}", server, genuine) for worker, server in enumerate(servers)]
        for path in LOAD_PATHS:  # every baseline first, on one worker
            fuzzers[0].baseline(path)
        for other in fuzzers[1:]:
            other.baselines = fuzzers[0].baselines
        report = Report()
        last = time.monotonic()

        def work(worker: int) -> None:
            nonlocal last
            for index in range(worker, cases, workers):
                try:
                    report.outcomes.append(fuzzers[worker].run_case(seed, index, keep))
                except Exception as error:  # the fuzzer's own bug: reported as a failure, the run goes on
                    failure = f"the fuzzer failed: {type(error).__name__}: {error}"
                    report.outcomes.append(Outcome(seed, index, "?", [], -1, failure=failure))
                if progress and time.monotonic() - last > 30:
                    last = time.monotonic()
                    failed = len(report.failures)
                    print(f"fuzz: {len(report.outcomes)}/{cases} cases, {failed} failed, "
                          f"{time.monotonic() - start:.0f} s", flush=True)  # fmt: skip

        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(work, range(workers)))
        report.outcomes.sort(key=lambda outcome: outcome.index)
        report.peak_address_space = max(f.rlimit for f in fuzzers) - ADDRESS_SPACE_BOUND
    finally:
        for server in servers:
            server.close()
    report.seconds = time.monotonic() - start
    return report


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz.run")
    parser.add_argument("--cases", type=int, default=300)
    parser.add_argument("--seed", default=None, help="default: a fresh one, printed")
    parser.add_argument("--case", type=int, default=None, help="run this one case only")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--keep", type=Path, default=None, help="copy failing cases (with --case: the case) here")
    args = parser.parse_args(argv)
    seed = args.seed or str(random.SystemRandom().randrange(10**9))
    print(f"fuzz: seed {seed}", flush=True)
    with tempfile.TemporaryDirectory(prefix="torchpre-fuzz-") as folder:
        if args.case is not None:
            server = ForkServer(Path(folder) / "server.log", timeout_s=120)
            try:
                fuzzer = Fuzzer(Path(folder), server, build(Path(folder) / "genuine", server))
                outcome = fuzzer.run_case(seed, args.case, args.keep, keep_all=True)
            finally:
                server.close()
            print(outcome.describe())
            return 1 if outcome.failure else 0
        report = fuzz(args.cases, seed, Path(folder), args.workers, args.keep, progress=True)
    print(report.summary())
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

