"""bench/gpu.sh, the prepared device call: its two frameworks get the same run, and its smoke mode (the
offline install from bench/wheels, torchpre's dry run of the real 1B shape, torchtitan's check of the
same shape, a tiny torchpre run) passes on CPU."""

import os
import subprocess
import sys

import pytest

from bench.gpu_compare import ROWS, TWO_GPU_ROW, titan_command, torchpre_command
from tests.launch import REPO, WORKER_ENV


def _flags(command: list[str]) -> dict[str, str]:
    """`--key value` pairs of a command line; flags without a value map to ''."""
    flags, key = {}, None
    for token in command:
        if token.startswith("--"):
            key, flags[token] = token, ""
        elif key is not None:
            flags[key], key = token, None
    return flags


@pytest.mark.parametrize("row", [*ROWS, TWO_GPU_ROW], ids=lambda row: row.label)
def test_both_frameworks_get_the_same_run(row, tmp_path):
    ours, theirs = _flags(torchpre_command(row, 15, tmp_path)), _flags(titan_command(row, 15, tmp_path))
    for key in ("--model.flavor", "--training.seq_len", "--training.local_batch_size", "--training.steps",
                "--training.mixed_precision_param", "--lr_scheduler.warmup_steps", "--metrics.log_freq"):
        assert ours[key] == theirs[key], key
    assert int(theirs["--training.global_batch_size"]) == int(ours["--training.local_batch_size"]) * row.nproc
    assert ours["--model.vocab_size"] == "128256" and ours["--training.dataset"] == "synthetic"
    assert ("--compile.enable" in ours) == ("--compile.enable" in theirs) == row.compile
    assert theirs["--activation_checkpoint.mode"] == "none"  # torchpre's default; torchtitan's is selective


@pytest.mark.slow
@pytest.mark.skipif(not (REPO / "bench" / "wheels").is_dir(), reason="run bash bench/prepare_gpu_wheels.sh first")
def test_smoke_mode_installs_offline_and_checks_the_first_row(tmp_path):
    env = {**os.environ, **WORKER_ENV, "GPU_BENCH_SMOKE": "1", "PYTHON": sys.executable,
           "GPU_BENCH_SITE": str(tmp_path / "site"), "OUT": str(tmp_path / "out")}  # fmt: skip
    result = subprocess.run(
        ["bash", "bench/gpu.sh", "--max-rows", "1", "--work", str(tmp_path / "work")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "torchtitan 0.2.2" in result.stdout
    row = ROWS[0].label
    assert f"smoke {row}: torchpre dry run ok" in result.stdout
    assert f"smoke {row}: torchtitan check ok" in result.stdout
    assert "torchpre trains 2 steps with these flags on a tiny model: ok" in result.stdout
