"""torchpre as an installed package: `python -m torchpre.train` trains like the train.py shim, and
`torchrun -m torchpre.train`, started in a user's own folder, trains a model family that the user's package
registers through `job.custom_import` before the job is checked."""

import json
import math
import os
import subprocess
import sys

import pytest

from tests.launch import DEBUG, REPO, train_and_read_metrics

pytestmark = pytest.mark.slow

STEPS = ["--job.config_file", "train_configs/debug_model.toml", "--training.steps", "2"]

USER_MODEL = """
import dataclasses

from torchpre.models.llama3.args import LLAMA3_FLAVORS
from torchpre.models.llama3.spec import SPEC
from torchpre.models.registry import register_model

register_model("my-llama", dataclasses.replace(SPEC, flavors={"mine": LLAMA3_FLAVORS["tiny"]}))
"""


def test_python_m_torchpre_train_trains_like_the_shim(tmp_path):
    """The same main behind both: the same losses, bit for bit (one process, fp32 on CPU, deterministic)."""
    module = train_and_read_metrics(
        [*STEPS, *DEBUG], 1, tmp_path / "module", script="torchpre.train", launcher="torchrun"
    )
    shim = train_and_read_metrics([*STEPS, *DEBUG], 1, tmp_path / "shim")
    assert [r["step"] for r in module] == [1, 2]
    assert [r["loss"] for r in module] == [r["loss"] for r in shim]


def test_torchrun_m_trains_a_family_from_the_users_package(tmp_path):
    """Run from the user's folder (torchpre importable as if installed): `my_package.my_model` is imported
    before the config is checked, so `model.name = "my-llama"` exists; dp2 gives the global-batch loss."""
    package = tmp_path / "my_package"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "my_model.py").write_text(USER_MODEL)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "torchpre.train",
        "--job.custom_import",
        "my_package.my_model",
        "--model.name",
        "my-llama",
        "--model.flavor",
        "mine",
        "--training.steps",
        "2",
        "--training.seq_len",
        "32",
        "--training.local_batch_size",
        "2",
        "--metrics.log_freq",
        "1",
        "--job.dump_folder",
        str(tmp_path / "run"),
    ]
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["loss"] == pytest.approx(math.log(2048), abs=0.5)  # the tiny flavor starts near uniform
    assert "model my-llama mine" in result.stdout
