"""Context extension as a resumed stage: a checkpoint trained on 32-token sequences resumes on 64-token ones, on one
process and split over two cp ranks; both say what changed, and train on identically (the longer RoPE table, the
kept data position and global batch in sequences do not depend on the layout)."""

import json
import shutil
from pathlib import Path

import pytest

from tests.launch import TINY, run_train

pytestmark = pytest.mark.slow

STAGE_1 = [*TINY, "--training.seq_len", "32", "--training.steps", "4", "--checkpoint.enable"]
STAGE_2 = [*TINY, "--training.seq_len", "64", "--training.steps", "8", "--checkpoint.enable"]
CP2 = ["--parallelism.context_parallel_degree", "2"]
# fp32 on CPU: the cp2 resume reorders only the key/value gradient sums (the cp parity rows measure 1.9e-6).
LOSS_ATOL = 1e-5


def resume(saved: Path, folder: Path, args: list[str], nproc: int) -> tuple[list[dict], str]:
    """Stage 2 in `folder`, from stage 1's last checkpoint; its metrics records and its log."""
    shutil.copytree(saved / "checkpoint" / "step-4", folder / "checkpoint" / "step-4")
    result = run_train([*STAGE_2, *args], nproc, folder)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return records, result.stdout + result.stderr


def test_a_longer_context_stage_resumes_alike_on_one_process_and_under_cp2(tmp_path):
    saved = tmp_path / "stage1"
    result = run_train(STAGE_1, 1, saved)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    one, _ = resume(saved, tmp_path / "one", [], 1)
    cp2, log = resume(saved, tmp_path / "cp2", CP2, 2)
    assert [r["step"] for r in cp2] == [r["step"] for r in one] == [5, 6, 7, 8]
    assert [r["loss"] for r in cp2] == pytest.approx([r["loss"] for r in one], abs=LOSS_ATOL)
    assert "stage change at step 4: training.seq_len 32 -> 64 (context extension)" in log
    assert "the global batch is 4 sequences = 256 tokens per step" in log
    assert "1 rank as dp 1 x tp 1 x pp 1 (ep 1)" in log and "2 ranks as dp 1 x tp 1 x pp 1 x cp 2 (ep 1)" in log
