"""A shard folder at the scale of a real run trains like a small one (issue 66).

train.py runs one step on a folder of many tiny shards and on a folder of 10, one after the other in this test, each
a fresh process limited to 1,024 descriptors (so that training at all proves the bound): the large folder's peak RSS
is within 10% and its time to the end of step 1 within 2x of the small one's. CI runs 10,000 shards; `-m data_scale`
runs 100,000."""

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launch import REPO, TINY, WORKER_ENV
from tests.shard_folders import write_many_shards
from torchpre.data.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer

pytestmark = pytest.mark.slow

TOKENIZER = load_tokenizer(DEFAULT_TOKENIZER_PATH)
DESCRIPTORS = 1024


def shard_folder(folder: Path, count: int, tokens_per_shard: int = 64, sparse: bool = False) -> Path:
    return write_many_shards(folder, count, tokens_per_shard, vocab_size=TOKENIZER.vocab_size, sparse=sparse,
                             tokenizer_name=DEFAULT_TOKENIZER_PATH.name, sha256=TOKENIZER.sha256)  # fmt: skip


def train_one_step(folder: Path, dump: Path, *args: str) -> tuple[float, int]:
    """(seconds, peak RSS in bytes) of train.py running one step on `folder` in a fresh process held to
    `DESCRIPTORS` open files."""
    command = [sys.executable, "train.py", *TINY, "--training.dataset", "shards", "--training.dataset_path",
               str(folder), "--training.steps", "1", "--job.dump_folder", str(dump), *args]  # fmt: skip
    dump.mkdir(parents=True)
    with (dump / "out.txt").open("w") as out:
        start = time.perf_counter()
        process = subprocess.Popen(command, cwd=REPO, env={**os.environ, **WORKER_ENV}, stdout=out, stderr=out,
                                   preexec_fn=_limit_descriptors)  # fmt: skip
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    assert process.returncode == 0, (dump / "out.txt").read_text()[-3000:]
    return seconds, usage.ru_maxrss * 1024


def _limit_descriptors() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (DESCRIPTORS, DESCRIPTORS))


@pytest.mark.parametrize("count", [10_000, pytest.param(100_000, marks=pytest.mark.data_scale)])
def test_a_folder_of_many_shards_trains_like_one_of_ten(count, tmp_path):
    many = shard_folder(tmp_path / "many", count)
    few = shard_folder(tmp_path / "few", 10)
    few_seconds, few_rss = train_one_step(few, tmp_path / "run_few")
    many_seconds, many_rss = train_one_step(many, tmp_path / "run_many")
    print(f"\n{count:,} shards: {many_seconds:.1f} s, {many_rss / 2**20:.0f} MiB; "
          f"10 shards: {few_seconds:.1f} s, {few_rss / 2**20:.0f} MiB")  # fmt: skip
    assert many_rss <= 1.10 * few_rss
    assert many_seconds <= 2 * few_seconds
