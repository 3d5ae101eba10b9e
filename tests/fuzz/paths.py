"""Every way torchpre reads a file from someone else, as the fuzzer runs it: which genuine inputs a case copies, the
command, the files and folders a mutation may target (with their format), and what the command's result is."""

import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from tests.fuzz import formats
from tests.fuzz.genuine import BASE, CHECKPOINTED, OLD_RUN, SNAPSHOTS, Genuine
from torchpre.checkpoint.snapshots.file_format import parse_name

STEP = "checkpoint/step-2"
DATA_VOCAB = 2048 + 2  # the shipped tokenizer's ranks and its BOS and EOS


@dataclass(frozen=True)
class Target:
    """A file or folder of the case a mutation may change: its path under the case's `in/`, its format (a key of
    `mutator`), and the same entry of another genuine input (under the case's `outside/`), for a link to lead to."""

    path: str
    format: str
    decoy: str | None = None


@dataclass(frozen=True)
class Scope:
    """A folder of the case's inputs whose every file (not its subfolders) a mutation may target (`folder`, under
    `in/`), with the same folder of another genuine input under `outside/` (`decoy`); `entry`: the folder itself may
    be replaced too (a folder torchpre finds by scanning, such as step-N, rather than one the command names)."""

    folder: str
    decoy: str | None = None
    entry: bool = False


@dataclass(frozen=True)
class LoadPath:
    name: str
    copies: dict[str, str]  # folder under in/ -> genuine folder
    decoys: dict[str, str]  # folder under outside/ -> genuine folder
    command: Callable[[Path, Path, Genuine], tuple[str, list[str]]]  # (in/, out/, genuine) -> (entry, argv)
    scopes: list[Scope]
    result: Callable[[Path, Path, dict], Any]  # (in/, out/, reply) -> what must equal the genuine input's
    written: tuple[str, ...] = ()  # files (under in/) the command writes, whether or not they exist yet
    named: tuple[str, ...] = ()  # files (under in/) the command names: a link there is the user's choice
    weight: float = 1.0
    nproc: int = 1  # ranks of one job: each must refuse bad input with its own message
    timeout_s: float = 30  # a case takes a second at most on an idle machine: longer is a hang

    def targets(self, case_in: Path) -> list[Target]:
        """Every file of the scopes as the case holds them, each scope's folder where it may go, and the written."""
        found = []
        for scope in self.scopes:
            folder = case_in / scope.folder
            # the folders inside one are named by the config (checkpoint.folder), where a link is the user's choice
            names = sorted(path.name for path in folder.iterdir() if not path.is_dir()) if folder.is_dir() else []
            found += [Target(f"{scope.folder}/{name}", format_of(name), scope.decoy and f"{scope.decoy}/{name}")
                      for name in names]  # fmt: skip
            if scope.entry:
                found.append(Target(scope.folder, "entry", scope.decoy))
        return found + [Target(name, "entry") for name in self.written]


def format_of(name: str) -> str:
    """Which mutator a file gets, by its name."""
    if name == ".metadata":
        return "metadata"
    if parse_name(name) is not None:
        return "snapshot"
    if name == "config.json":
        return "hf-config"
    if name == "metrics.jsonl":
        return "metrics"
    if name == "tokenizer.model":
        return "tokenizer"
    if name in ("tokenizer.json", "tokenizer_config.json"):
        return "tokenizer-json"
    if name == "input.txt":
        return "text"
    if name.startswith("shard_") and name.endswith(".bin"):
        return "tokens"
    suffixes = {".distcp": "distcp", ".safetensors": "safetensors", ".json": "json", ".jsonl": "task",
                ".idx": "binary"}  # fmt: skip
    return next((kind for suffix, kind in suffixes.items() if name.endswith(suffix)), "entry")


def mutator(format: str, case: Path, genuine: Genuine) -> formats.Mutator:
    """The mutator of a format; `case` for the gadgets' payload marker, `genuine` for what may be unpickled."""
    outside = case / "outside"
    return {
        "json": formats.json_file(),
        "hf-config": formats.json_file(defaults_on_delete=True),
        "metadata": formats.dcp_metadata(outside, genuine.metadata_digests),
        "safetensors": formats.safetensors_file,
        "snapshot": formats.snapshot_file,
        "distcp": formats.binary(may_change=True),
        "binary": formats.binary(may_change=False),
        "tokens": formats.shard_tokens(DATA_VOCAB),
        "tokenizer": formats.tokenizer_file,
        "tokenizer-json": formats.json_file(values_may_change=True),
        "task": formats.json_lines(may_change_values=False),
        "metrics": formats.json_lines(may_change_values=True),
        "text": formats.text_file,
        "entry": lambda path, rng: ("left as it is", False),  # only the file system mutations
    }[format]


# Results --------------------------------------------------------------------------------------------------------------


def last_record(dump: str, keys: tuple[str, ...] = ("step", "loss", "grad_norm")) -> Callable[[Path, Path, dict], Any]:
    def result(case_in: Path, out: Path, reply: dict) -> Any:
        lines = (case_in / dump / "metrics.jsonl").read_text().splitlines()
        record = json.loads(lines[-1])
        return {key: record[key] for key in record if key in keys or key.startswith("eval/")}

    return result


def generated(case_in: Path, out: Path, reply: dict) -> Any:
    return json.loads(reply["stdout"].strip().splitlines()[-1])["token_ids"]


def exported(case_in: Path, out: Path, reply: dict) -> Any:
    tensors = {}
    for path in sorted((out / "hf").glob("*.safetensors")):
        tensors |= {name: _digest(value.numpy().tobytes()) for name, value in load_file(path).items()}
    return {"tensors": tensors, "config": json.loads((out / "hf" / "config.json").read_text())}


def converted(case_in: Path, out: Path, reply: dict) -> Any:
    return {path.name: _digest(path.read_bytes()) for path in sorted((out / "step-0").glob("*.distcp"))}


def planned(case_in: Path, out: Path, reply: dict) -> Any:
    text = reply["stdout"]
    plan = json.loads(text[text.index("{") :])
    plan.pop("seconds", None)
    return plan


def prepared(case_in: Path, out: Path, reply: dict) -> Any:
    manifest = json.loads((out / "shards" / "manifest.json").read_text())
    files = {path.name: _digest(path.read_bytes()) for path in sorted((out / "shards").glob("*.bin"))}
    return {"shards": manifest["shards"], "files": files}


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


# The load paths -------------------------------------------------------------------------------------------------------


def _resume(load_step: str, dump: str = "run", extra: tuple[str, ...] = ()) -> Callable:
    def command(case_in: Path, out: Path, genuine: Genuine) -> tuple[str, list[str]]:
        argv = [*BASE, *CHECKPOINTED, "--training.steps", "3", "--checkpoint.load_step", load_step,
                "--job.dump_folder", str(case_in / dump), *extra]  # fmt: skip
        if dump == "signed":
            argv += ["--checkpoint.signing_key_file", str(genuine.key)]
        return "train.py", argv

    return command


def _resume_snapshots(case_in: Path, out: Path, genuine: Genuine) -> tuple[str, list[str]]:
    """The run of `genuine.build` that lost its last step: its snapshots of step 3 are newer than its step-2."""
    return "train.py", [*BASE, *SNAPSHOTS(case_in / "snap"), "--job.dump_folder", str(case_in / "snap")]


def _train_on(extra: Callable[[Path], list[str]], dump: str = "run") -> Callable:
    def command(case_in: Path, out: Path, genuine: Genuine) -> tuple[str, list[str]]:
        return "train.py", [*BASE, "--training.steps", "1", "--job.dump_folder", str(out / dump), *extra(case_in)]

    return command


def _out_record(keys: tuple[str, ...] = ("step", "loss", "grad_norm")) -> Callable:
    def result(case_in: Path, out: Path, reply: dict) -> Any:
        return last_record("run", keys)(out, out, reply)

    return result


def _step(folder: str, decoy: str = "other") -> Scope:
    return Scope(f"{folder}/{STEP}", f"{decoy}/{STEP}", entry=True)


# What a resumed run writes into its folder, each a name a link may take first.
RUN_WRITES = ("run/metrics.jsonl", "run/config.toml", "run/checkpoint/step-3", "run/checkpoint/.tmp-step-3",
              "run/metrics.superseded-from-step-2.jsonl", "run/checkpoint/run.json")  # fmt: skip
# ... and a run resumed from its snapshots (what it writes into their folder is not listed: a mutation may have put
# a file or a link in the folder's place, and the fuzzer plants nothing under a file).
SNAP_WRITES = ("snap/metrics.jsonl", "snap/config.toml", "snap/checkpoint/step-4", "snap/checkpoint/.tmp-step-4",
               "snap/metrics.superseded-from-step-2.jsonl", "snap/metrics.superseded-from-step-3.jsonl")  # fmt: skip
OTHER_DATA = {"other_data": "data"}
OTHER_DATA_HF = {"other_data_hf": "data_hf"}

LOAD_PATHS = [
    LoadPath("resume", {"run": "run"}, {"other": "other"}, _resume("2"), [_step("run"), Scope("run")],
             last_record("run"), written=RUN_WRITES, weight=3),
    LoadPath("resume-latest", {"run": "run"}, {"other": "other"}, _resume("-1"), [_step("run"), Scope("run")],
             last_record("run"), written=RUN_WRITES, weight=2),
    LoadPath("resume-dp2", {"run": "run"}, {"other": "other"}, _resume("2", extra=("--training.local_batch_size", "2")),
             [_step("run")], last_record("run"), nproc=2),
    LoadPath("resume-snapshot", {"snap": "snap"}, {"other": "other"}, _resume_snapshots,
             [Scope("snap/shm/fuzz", entry=True), _step("snap")], last_record("snap"), written=SNAP_WRITES, weight=2),
    LoadPath("resume-signed", {"signed": "signed"}, {"other": "other"}, _resume("2", "signed"),
             [_step("signed"), Scope("signed/checkpoint")], last_record("signed"), weight=2),
    LoadPath("resume-0a62600", {"legacy": "legacy"}, {"other": "other"},
             lambda case_in, out, genuine: ("train.py", [*OLD_RUN, *CHECKPOINTED, "--training.steps", "3",
                                                         "--checkpoint.load_step", "2",
                                                         "--job.dump_folder", str(case_in / "legacy")]),
             [_step("legacy")], last_record("legacy")),
    LoadPath("initial-dcp", {"ckpt": "run"}, {"other": "other"},
             _train_on(lambda case_in: ["--checkpoint.initial_load_path", str(case_in / "ckpt" / STEP)]),
             [Scope(f"ckpt/{STEP}", f"other/{STEP}")], _out_record()),
    LoadPath("initial-hf", {"hf": "hf"}, {"hf_other": "hf_other"},
             _train_on(lambda case_in: ["--checkpoint.initial_load_path", str(case_in / "hf")]),
             [Scope("hf", "hf_other")], _out_record()),
    LoadPath("initial-hf-single", {"hf1": "hf1"}, {"hf_other": "hf1"},
             _train_on(lambda case_in: ["--checkpoint.initial_load_path", str(case_in / "hf1")]),
             [Scope("hf1", "hf_other")], _out_record()),
    LoadPath("generate", {"run": "run"}, {"other": "other"},
             lambda case_in, out, genuine: ("torchpre.generate", [
                 "--model.flavor", "tiny", "--checkpoint.folder", str(case_in / "run" / "checkpoint"), "--prompt",
                 "hello", "--max_new_tokens", "2", "--temperature", "0", "--json", "--job.dump_folder", str(out)]),
             [_step("run")], generated),
    LoadPath("dcp-to-hf", {"ckpt": "run"}, {"other": "other"},
             lambda case_in, out, genuine: ("torchpre.convert", [
                 "dcp-to-hf", str(case_in / "ckpt" / STEP), str(out / "hf"), "--model.flavor", "tiny"]),
             [Scope(f"ckpt/{STEP}", f"other/{STEP}")], exported),
    LoadPath("hf-to-dcp", {"hf": "hf"}, {"hf_other": "hf_other"},
             lambda case_in, out, genuine: ("torchpre.convert", [
                 "hf-to-dcp", str(case_in / "hf"), str(out / "step-0"), "--model.flavor", "tiny"]),
             [Scope("hf", "hf_other")], converted),
    LoadPath("plan-from-hf", {"hf": "hf"}, {"hf_other": "hf_other"},
             lambda case_in, out, genuine: ("torchpre.plan", [
                 "--gpus", "1", "--fixed", "--json", "--model.flavor", "from_hf", "--checkpoint.initial_load_path",
                 str(case_in / "hf"), "--training.seq_len", "32", "--training.local_batch_size", "4"]),
             [Scope("hf", "hf_other")], planned, weight=0.5),
    LoadPath("prepare", {"data": "data"}, OTHER_DATA,
             lambda case_in, out, genuine: ("torchpre.data.prepare", [
                 str(case_in / "data" / "input.txt"), "--output", str(out / "shards"), "--tokenizer",
                 str(case_in / "data" / "tokenizer.model"), "--workers", "1"]),
             [Scope("data", "other_data")], prepared, named=("data/input.txt", "data/tokenizer.model")),
    LoadPath("shards", {"data": "data"}, OTHER_DATA,
             _train_on(lambda case_in: ["--training.dataset", "shards", "--training.dataset_path",
                                        str(case_in / "data" / "shards"), "--model.tokenizer_path",
                                        str(case_in / "data" / "tokenizer.model")]),
             [Scope("data/shards", "other_data/shards"), Scope("data", "other_data")], _out_record(),
             named=("data/tokenizer.model",)),
    LoadPath("prepare-hf-tokenizer", {"data_hf": "data_hf"}, OTHER_DATA_HF,
             lambda case_in, out, genuine: ("torchpre.data.prepare", [
                 str(case_in / "data_hf" / "input.txt"), "--output", str(out / "shards"), "--tokenizer",
                 str(case_in / "data_hf"), "--workers", "1"]),
             [Scope("data_hf", "other_data_hf")], prepared, named=("data_hf/input.txt",)),
    LoadPath("initial-hf-tokenizer", {"hf_tokenizer": "hf_tokenizer", "data_hf": "data_hf"}, {"hf_other": "hf_other"},
             _train_on(lambda case_in: ["--model.flavor", "from_hf", "--checkpoint.initial_load_path",
                                        str(case_in / "hf_tokenizer"), "--training.dataset", "shards",
                                        "--training.dataset_path", str(case_in / "data_hf" / "shards")]),
             [Scope("hf_tokenizer", "hf_other"), Scope("data_hf/shards", "hf_other")], _out_record()),
    LoadPath("eval-tasks", {"data": "data"}, OTHER_DATA,
             _train_on(lambda case_in: ["--eval.tasks", str(case_in / "data" / "task.jsonl"), "--eval.freq", "1"]),
             [Scope("data", "other_data")], _out_record(("step", "loss")), named=("data/task.jsonl",)),
]  # fmt: skip
BY_NAME = {path.name: path for path in LOAD_PATHS}


def choose(rng: random.Random) -> LoadPath:
    return rng.choices(LOAD_PATHS, weights=[path.weight for path in LOAD_PATHS])[0]
