"""A recipe in phases: a global-batch ramp (4 -> 8 -> 12 sequences over 16 samples) and two data stages (a web/code
mixture at 32 tokens, then from the WSD decay an annealing stage on a third folder at 64 tokens). One process is the
reference; dp2 under ZeRO-3 takes the same steps, and so does a resume of it stopped mid-ramp under tp2 (another
layout: other microbatches per step, another sharding of the weights) and under pp2 (the schedule rebuilt for each
microbatch count and sequence length).

fp32 on CPU: the layouts change only reduction orders (measured: at most 9.5e-7 apart, see each test), so they agree
within 1e-5."""

import json
from pathlib import Path

import pytest

from tests.integration.test_checkpoint import losses, resume, resume_with_log
from tests.integration.test_data_at_scale import documents
from tests.launch import TINY, read_checkpoint, train_and_read_metrics
from tests.unit.test_shard_data import write_shard_folder

pytestmark = pytest.mark.slow

LOSS_ATOL = 1e-5
# The ramp's batch at each step: 4 (consumed 0), 4 (4), 8 (8: one increment every 8 samples), then 12 (16 and on).
BATCHES = [4, 4, 8, 12, 12, 12, 12, 12]
# 8 steps, warmup 2, decay_ratio 0.25: the decay is the last round(0.25 x 6) = 2 steps, and the annealing stage too.
STAGES = [1, 1, 1, 1, 1, 1, 2, 2]
DP2_ZERO3 = ["--parallelism.data_parallel_degree", "2", "--optimizer.zero_stage", "3"]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2"]


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> list[str]:
    """The arguments of the recipe's run: TINY at a local batch of 2 with the recipe's TOML."""
    root = tmp_path_factory.mktemp("recipe")
    web = write_shard_folder(root / "web", documents("web", 400))
    code = write_shard_folder(root / "code", documents("code", 150), shards=2)
    hq = write_shard_folder(root / "hq", documents("textbook", 200))
    config = root / "recipe.toml"
    config.write_text(
        f'[training]\ndataset = "shards"\nsteps = 8\nglobal_batch_size = 12\nbatch_rampup = "4,4,16"\n'
        f"[lr_scheduler]\nwarmup_steps = 2\ndecay_ratio = 0.25\n"
        f'[[training.data_stages]]\nname = "main"\nmixture = {{ {json.dumps(str(web))} = 0.7, '
        f"{json.dumps(str(code))} = 0.3 }}\n"
        f'[[training.data_stages]]\nname = "anneal"\nstart_at_decay = true\nmixture = {{ {json.dumps(str(hq))} = 1 }}\n'
        "seq_len = 64\n"
    )
    return ["--job.config_file", str(config), *TINY, "--training.local_batch_size", "2"]


@pytest.fixture(scope="module")
def one_process(recipe, tmp_path_factory) -> list[dict]:
    return train_and_read_metrics(recipe, 1, tmp_path_factory.mktemp("one"))


def test_the_recipe_ramps_and_changes_stage_on_one_process(one_process):
    assert [r["step"] for r in one_process] == list(range(1, 9))
    assert [r["global_batch_size"] for r in one_process] == BATCHES
    assert [r["data_stage"] for r in one_process] == STAGES
    # data_share/* counts the current stage's tokens: the main mixture's two sources, then the annealing folder's
    assert set(k for k in one_process[5] if k.startswith("data_share/")) == {"data_share/web", "data_share/code"}
    assert one_process[-1]["data_share/hq"] == 1.0
    # samples_per_sec is the step's batch over its time, so their ratio is the step's batch
    assert [round(r["samples_per_sec"] * r["step_time_s"]) for r in one_process] == BATCHES


def test_dp2_zero3_stopped_mid_ramp_resumes_under_tp2_on_the_same_losses(recipe, one_process, tmp_path):
    """dp2 x ZeRO-3 (1, 1, 2, 3 microbatches of 2 per rank as the batch grows) checkpoints every 2 steps; its step-2
    checkpoint (8 samples consumed, the ramp half way) resumes as tp2 (2, 4, 6 microbatches on one DP rank), and the
    tp2 run's step-6 checkpoint on one process, at the first step of the annealing stage.
    Measured: dp2 x ZeRO-3 within 4.8e-7 of one process, the tp2 resume and the annealing resume equal to it."""
    args = [*recipe, "--checkpoint.enable", "--checkpoint.interval", "2"]
    dp2 = train_and_read_metrics([*args, *DP2_ZERO3], 2, tmp_path)
    assert losses(dp2) == pytest.approx(losses(one_process), abs=LOSS_ATOL)
    assert [r["global_batch_size"] for r in dp2] == BATCHES
    assert read_checkpoint(tmp_path / "checkpoint" / "step-2")["dataloader"]["consumed_samples"] == 8
    tp2 = resume(tmp_path, [*args, *TP2], 2, from_step=2)
    assert [r["step"] for r in tp2] == list(range(3, 9))
    assert [r["global_batch_size"] for r in tp2] == BATCHES[2:]
    assert [r["data_stage"] for r in tp2] == STAGES[2:]
    assert losses(tp2) == pytest.approx(losses(one_process)[2:], abs=LOSS_ATOL)
    final = read_checkpoint(tmp_path / "checkpoint" / "step-8")
    assert final["dataloader"]["consumed_samples"] == sum(BATCHES)
    assert (final["train"]["global_batch_size"], final["train"]["seq_len"]) == (12, 64)
    # A resume at the annealing stage's first step, on one process, enters it from the checkpoint alone. Its config
    # weighs the stage's one folder 2 instead of 1: the same data, but a change to a stage still to come, noted.
    config = tmp_path / "reweighted.toml"
    config.write_text(Path(recipe[1]).read_text().replace(" = 1 }", " = 2 }"))
    annealing, log = resume_with_log(tmp_path, [*args, "--job.config_file", str(config)], 1, from_step=6)
    assert "resuming at step 6 after 52 samples: global batch 12, data stage 2 ('anneal', start_step 6)" in log
    assert "training.data_stages: the steps from 6 on change from from step 6: {" in log
    assert "hq=1} at seq_len 64 to from step 6: {" in log and "hq=2} at seq_len 64 (they have not been taken" in log
    assert losses(annealing) == pytest.approx(losses(one_process)[6:], abs=LOSS_ATOL)


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(PP2, id="pp2-1F1B"),
        pytest.param([*PP2, "--parallelism.pipeline_parallel_schedule", "GPipe"], id="pp2-GPipe",
                     marks=pytest.mark.parity_matrix),
        pytest.param(["--parallelism.data_parallel_degree", "2", "--optimizer.zero_stage", "2"], id="dp2-zero2",
                     marks=pytest.mark.parity_matrix),
        pytest.param(["--parallelism.data_parallel_degree", "2", "--optimizer.zero_stage", "1"], id="dp2-zero1",
                     marks=pytest.mark.parity_matrix),
        pytest.param(["--parallelism.context_parallel_degree", "2"], id="cp2", marks=pytest.mark.parity_matrix),
    ],
)  # fmt: skip
def test_the_recipe_under_another_layout_takes_one_process_steps(recipe, one_process, layout, tmp_path):
    """pp2: the schedule runs 4, 8, then 12 microbatches of one sequence, at 32 then 64 tokens (one schedule per
    shape). Measured against one process: pp2 1F1B and GPipe 9.5e-7, dp2 ZeRO-1 and ZeRO-2 4.8e-7, cp2 9.5e-7."""
    records = train_and_read_metrics([*recipe, *layout], 2, tmp_path)
    assert [r["global_batch_size"] for r in records] == BATCHES
    assert losses(records) == pytest.approx(losses(one_process), abs=LOSS_ATOL)
