"""The genuine inputs every case starts from, made once per run of the fuzzer by torchpre itself (and a Hugging Face
tokenizer by the tokenizers library's trainer, scripts/tiny_tokenizer.py)."""

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from scripts import tiny_tokenizer
from tests.launch import REPO, TINY, ForkServer

KEY = "0123456789abcdef0123456789abcdef"
# The tiny model on synthetic data, with the MFU peak given (its CPU benchmark would cost each case a second).
BASE = [*TINY, "--training.dataset", "synthetic", "--metrics.peak_flops", "1e11"]
CHECKPOINTED = ["--checkpoint.enable", "--checkpoint.interval", "2"]
# A run of 4 steps with in-memory snapshots in its own folder: its disk checkpoints are step-2 and step-4, its
# snapshots those of steps 2 and 3, and its run id "fuzz" (the name of its snapshots' folder).
SNAPSHOTS = lambda folder: [  # noqa: E731
    *CHECKPOINTED, "--training.steps", "4", "--checkpoint.memory_interval", "1",
    "--checkpoint.memory_folder", str(folder / "shm"),
]  # fmt: skip
OLD_CHECKPOINT = REPO / "tests" / "fixtures" / "checkpoint_0a62600" / "step-2"
# The run that wrote OLD_CHECKPOINT (tests/integration/test_bitwise_losses.py).
OLD_RUN = [
    "--model.flavor", "tiny", "--model.vocab_size", "256", "--training.dataset", "synthetic",
    "--training.seq_len", "32", "--training.local_batch_size", "4", "--lr_scheduler.warmup_steps", "2",
    "--lr_scheduler.min_lr_factor", "0.1", "--metrics.log_freq", "1", "--metrics.peak_flops", "1e11",
]  # fmt: skip
TEXT = "The quick brown fox jumps over the lazy dog. It was the best of times, it was the worst of times.\n"
TASK = [
    {"context": "The capital of France is", "choices": [" Paris", " Rome", " Berlin"], "answer": 0},
    {"context": "Two plus two is", "choices": [" four", " five"], "answer": 0},
    {"context": "Water is", "choices": [" wet", " dry", " loud", " square"], "answer": 0},
]


@dataclass
class Genuine:
    """Where the genuine inputs are: each a folder to copy into a case (`folder`), and the key of the signed run."""

    root: Path

    @property
    def key(self) -> Path:
        return self.root / "key"

    def folder(self, name: str) -> Path:
        return self.root / name

    @functools.cached_property
    def metadata_digests(self) -> set[str]:
        """The SHA-256 of every genuine `.metadata`: the files the fuzzer may unpickle itself."""
        return {hashlib.sha256(path.read_bytes()).hexdigest() for path in self.root.glob("*/checkpoint/*/.metadata")}


def build(root: Path, server: ForkServer) -> Genuine:
    """Makes every genuine input under `root` with torchpre's own commands; a command that fails stops the fuzzer."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "key").write_text(KEY)

    def run(entry: str, argv: list[str]) -> None:
        reply = server.request({"entry": entry, "argv": argv, "env": {}, "timeout_s": 300})
        assert reply["returncode"] == 0, f"{entry} {argv}: {reply['stderr'][-3000:]}"

    for name, extra in (("run", []), ("other", ["--training.seed", "7"]),
                        ("signed", ["--checkpoint.signing_key_file", str(root / "key")])):  # fmt: skip
        run("train.py", [*BASE, *CHECKPOINTED, "--training.steps", "2", "--job.dump_folder", str(root / name), *extra])
    for name, source, shard in (("hf", "run", "300KB"), ("hf1", "run", "5GB"), ("hf_other", "other", "300KB")):
        step = root / source / "checkpoint" / "step-2"
        run("torchpre.convert", ["dcp-to-hf", str(step), str(root / name), "--model.flavor", "tiny",
                                 "--max_shard_size", shard])  # fmt: skip
    _snapshot_run(root / "snap")
    legacy = root / "legacy" / "checkpoint" / "step-2"
    shutil.copytree(OLD_CHECKPOINT, legacy)
    data = root / "data"
    data.mkdir()
    (data / "input.txt").write_text(TEXT * 40)
    shutil.copy(REPO / "assets" / "tokenizer" / "tokenizer.model", data / "tokenizer.model")
    run("torchpre.data.prepare", [str(data / "input.txt"), "--output", str(data / "shards"),
                                  "--tokenizer", str(data / "tokenizer.model"), "--workers", "1"])  # fmt: skip
    (data / "task.jsonl").write_text("".join(json.dumps(question) + "\n" for question in TASK))
    # A Hugging Face tokenizer (Qwen's kind), text prepared with it, and a released folder that ships it.
    data_hf = tiny_tokenizer.write("byte_level", root / "data_hf")
    (data_hf / "input.txt").write_text(TEXT * 40)
    run("torchpre.data.prepare", [str(data_hf / "input.txt"), "--output", str(data_hf / "shards"),
                                  "--tokenizer", str(data_hf), "--workers", "1"])  # fmt: skip
    shutil.copytree(root / "hf", root / "hf_tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(data_hf / name, root / "hf_tokenizer" / name)
    return Genuine(root)



def _snapshot_run(folder: Path) -> None:
    """The snapshot run, killed (as a lost node is) after its last step, before its normal end removed its snapshots
    and, as if its last save never finished, without step-4: a resume takes its snapshots of step 3."""
    (folder / "checkpoint").mkdir(parents=True)
    (folder / "checkpoint" / "run.json").write_text(json.dumps({"run": "fuzz"}) + "\n")
    keep = (
        "from torchpre.checkpoint.snapshots.manager import SnapshotManager as M; "
        "M.close = lambda s, finished: s.wait()"
    )
    script = f"{keep}; import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path('train.py', run_name='__main__')"
    argv = ["train.py", *BASE, *SNAPSHOTS(folder), "--job.dump_folder", str(folder)]
    result = subprocess.run([sys.executable, "-c", script, *argv], cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    shutil.rmtree(folder / "checkpoint" / "step-4")
    assert sorted(path.name for path in (folder / "shm" / "fuzz").iterdir()) == ["rank0-step2.own", "rank0-step3.own"]
