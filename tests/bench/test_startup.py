"""bench.startup on a small flavor: it builds, resumes and initialises rank 0 under the fake process group and
prints one row per phase (the 8B numbers it reports in docs/performance.md take minutes)."""

import os
import subprocess
import sys

import pytest

from tests.launch import REPO, WORKER_ENV

pytestmark = pytest.mark.slow


def test_startup_bench_prints_each_phase():
    result = subprocess.run(
        [sys.executable, "-m", "bench.startup", "--flavor", "debugmodel", "--world", "4", "--tp", "2",
         "--seq_len", "64"],
        cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, **WORKER_ENV},
    )
    assert result.returncode == 0, result.stderr
    rows = [line.split("|")[1].strip() for line in result.stdout.splitlines() if line.startswith("| (")]
    assert rows == [
        "(a) meta build + parallelize",
        "(c) to_empty + init_buffers (resume)",
        "(b) to_empty + init_weights (fresh start)",
    ]
    assert "llama3 debugmodel" in result.stdout and "world 4, tp 2" in result.stdout
