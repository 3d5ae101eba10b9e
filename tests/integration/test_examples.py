"""The runnable examples docs/models.md quotes: a model registered through `job.custom_import` and trained by
train.py, and the parallelize API driven by hand."""

import math
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tests.launch import REPO, train_and_read_metrics
from torchpre.errors import ConfigError
from torchpre.models.hf.model import init_weights
from torchpre.runtime.custom_import import import_custom_module

GPT2 = [
    "--model.name", "gpt2",
    "--model.flavor", "tiny",
    "--training.seq_len", "32",
    "--training.local_batch_size", "4",
    "--training.steps", "4",
    "--lr_scheduler.warmup_steps", "2",
    "--metrics.log_freq", "1",
]
# fp32 on CPU; tp2 differs from one process only in reduction order (see the parity tests).
LOSS_TOLERANCE = 1e-4


@pytest.mark.slow
def test_custom_model_trains_under_tp2_like_one_process(tmp_path):
    """The module form on 2 processes (tp2) and the file form in one: the same losses."""
    one = train_and_read_metrics(["--job.custom_import", "examples/custom_model.py", *GPT2], 1, tmp_path / "one")
    tp2 = train_and_read_metrics(
        ["--job.custom_import", "examples.custom_model", *GPT2, "--parallelism.tensor_parallel_degree", "2"],
        2,
        tmp_path / "tp2",
    )
    assert one[0]["loss"] == pytest.approx(math.log(2048), abs=0.05)  # GPT-2 init: near-uniform predictions
    assert [r["loss"] for r in tp2] == pytest.approx([r["loss"] for r in one], abs=LOSS_TOLERANCE)


@pytest.mark.slow
def test_parallelize_api_example_trains_under_tp2_pp2():
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
               "examples/parallelize_api.py"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", result.stdout)]
    assert len(losses) == 10
    assert losses[0] == pytest.approx(math.log(256), abs=0.05)
    assert losses[-1] < losses[0] - 0.5  # one repeated batch: memorised quickly


@pytest.mark.slow
def test_hf_parallelize_example_trains_under_dp2_tp2_like_one_process():
    """transformers' LlamaForCausalLM under dp2 x tp2, ZeRO-1 and activation checkpointing: its first loss is the
    one-process model's on the same batch (fp32, reduction order only; printed to 6 decimals), and it falls."""
    pytest.importorskip("transformers")
    from examples import hf_parallelize as example  # imports transformers

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
               "examples/hf_parallelize.py"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", result.stdout)]
    assert len(losses) == example.STEPS

    model = example.LlamaForCausalLM(example.CONFIG)
    init_weights(model, example.SEED)
    batch = example.global_batch()
    with torch.no_grad():
        logits = model(batch[:, :-1]).logits
    reference = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()
    assert losses[0] == pytest.approx(reference, rel=0, abs=1e-5)
    assert losses[-1] < losses[0] - 0.5  # one repeated batch: memorised quickly


@pytest.mark.parametrize(
    "name, message",
    [("examples.no_such_module", "no module named 'examples.no_such_module'"), ("nowhere/model.py", "does not exist")],
)
def test_a_bad_custom_import_names_the_key(name, message):
    with pytest.raises(ConfigError, match=f"job.custom_import = '{name}'.*{re.escape(message)}"):
        import_custom_module(name)
