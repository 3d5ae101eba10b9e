"""Context extension as a resumed stage: a checkpoint trained on 32-token sequences resumes on 64-token ones, on one
process and split over two cp ranks; both say what changed, and train on identically (the longer RoPE table, the
kept data position and global batch in sequences do not depend on the layout). A new RoPE base takes effect (the
RoPE table is no checkpoint entry), and training.global_batch_unit = 'tokens' keeps the tokens per step. The same
stage change inside one uninterrupted run (`[[training.data_stages]]`) takes the resumed run's steps."""

import json
import shutil
from pathlib import Path

import pytest

from tests.launch import TINY, read_checkpoint, run_entry, run_train, train_and_read_metrics
from torchpre.checkpoint.integrity import FileCheck
from torchpre.checkpoint.state import checkpoint_metadata

pytestmark = pytest.mark.slow

# A constant LR after warmup (no decay), so that the 4-step stage 1 and an 8-step uninterrupted run take their first
# steps at the same LR.
CONSTANT_LR = ["--lr_scheduler.decay_ratio", "0"]
STAGE_1 = [*TINY, *CONSTANT_LR, "--training.seq_len", "32", "--training.steps", "4", "--checkpoint.enable"]
STAGE_2 = [*TINY, *CONSTANT_LR, "--training.seq_len", "64", "--training.steps", "8", "--checkpoint.enable"]
CP2 = ["--parallelism.context_parallel_degree", "2"]
# fp32 on CPU: the cp2 resume reorders only the key/value gradient sums (the cp parity rows measure 1.9e-6).
LOSS_ATOL = 1e-5


@pytest.fixture(scope="module")
def stage_1(tmp_path_factory) -> Path:
    """Stage 1's run folder: 4 steps of 4 sequences of 32 tokens, checkpointed at step 4."""
    saved = tmp_path_factory.mktemp("stage1")
    result = run_train(STAGE_1, 1, saved)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return saved


@pytest.fixture(scope="module")
def one_process(stage_1, tmp_path_factory) -> list[dict]:
    """Stage 2 on one process with the defaults (the flavor's RoPE, the global batch kept in sequences)."""
    return resume(stage_1, tmp_path_factory.mktemp("one"), [], 1)[0]


def resume(saved: Path, folder: Path, args: list[str], nproc: int) -> tuple[list[dict], str]:
    """Stage 2 in `folder`, from stage 1's last checkpoint; its metrics records and its log."""
    shutil.copytree(saved / "checkpoint" / "step-4", folder / "checkpoint" / "step-4")
    result = run_train([*STAGE_2, *args], nproc, folder)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return records, result.stdout + result.stderr


def test_a_longer_context_stage_resumes_alike_on_one_process_and_under_cp2(stage_1, one_process, tmp_path):
    cp2, log = resume(stage_1, tmp_path / "cp2", CP2, 2)
    assert [r["step"] for r in cp2] == [r["step"] for r in one_process] == [5, 6, 7, 8]
    assert [r["loss"] for r in cp2] == pytest.approx([r["loss"] for r in one_process], abs=LOSS_ATOL)
    assert "stage change at step 4: training.seq_len 32 -> 64 (context extension)" in log
    assert "the global batch is 4 sequences = 256 tokens per step" in log
    assert "1 rank as dp 1 x tp 1 x pp 1 (ep 1)" in log and "2 ranks as dp 1 x tp 1 x pp 1 x cp 2 (ep 1)" in log


def test_a_new_rope_base_takes_effect_and_is_stated(stage_1, one_process, tmp_path):
    """The RoPE table is a buffer the checkpoint does not hold, so the resumed model computes it from the new base,
    and trains on other losses than the resume on the flavor's base. After 4 steps the tiny model's attention is
    still nearly uniform, so the base moves them by ~1e-6 only; but one process repeats a run bitwise (the resume
    tests compare losses exactly), so any difference is the new base's."""
    saved = checkpoint_metadata(FileCheck(stage_1 / "checkpoint" / "step-4"))
    model_keys = [key for key in saved if key.startswith("model.")]
    assert model_keys and not [key for key in model_keys if "rope" in key]
    records, log = resume(stage_1, tmp_path / "theta", ["--model.rope_theta", "2000000"], 1)
    assert [r["step"] for r in records] == [5, 6, 7, 8]
    assert [r["loss"] for r in records] != [r["loss"] for r in one_process]
    assert "stage change at step 4: training.seq_len 32 -> 64, model.rope_theta 500000 -> 2000000 (context " in log
    # Generation and export read the RoPE from the config: without the stage's base they stop, naming it.
    checkpoint = ["--checkpoint.folder", str(tmp_path / "theta" / "checkpoint"), "--model.flavor", "tiny"]
    for entry, argv in (
        ("torchpre.generate", [*checkpoint, "--prompt", "def", "--max_new_tokens", "2"]),
        ("torchpre.convert", ["dcp-to-hf", str(tmp_path / "theta" / "checkpoint" / "step-8"), str(tmp_path / "hf"),
                              "--model.flavor", "tiny"]),
    ):  # fmt: skip
        refused = run_entry(entry, argv)
        assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
        assert "model.rope_theta = 2000000 (this run: 500000)" in refused.stderr
        assert "--model.rope_theta 2000000" in refused.stderr
    generated = run_entry("torchpre.generate", [*checkpoint, "--model.rope_theta", "2000000", "--prompt", "def",
                                                "--max_new_tokens", "2"])  # fmt: skip
    assert generated.returncode == 0, generated.stderr[-2000:]


def test_a_global_batch_in_tokens_keeps_the_tokens_per_step_and_the_data_position(stage_1, tmp_path):
    """4 sequences of 32 tokens per step become 2 of 64 (128 tokens); the data position continues from the 16
    sequences stage 1 consumed."""
    args = ["--training.global_batch_unit", "tokens", "--training.local_batch_size", "2"]
    records, log = resume(stage_1, tmp_path / "tokens", args, 1)
    assert [r["step"] for r in records] == [5, 6, 7, 8]
    assert all(round(r["tokens_per_sec"] / r["samples_per_sec"] * 2) == 128 for r in records)  # tokens per step
    assert "the global batch is 2 sequences = 128 tokens per step (training.global_batch_unit = 'tokens' kept" in log
    saved = read_checkpoint(tmp_path / "tokens" / "checkpoint" / "step-8")
    assert saved["dataloader"]["consumed_samples"] == 4 * 4 + 4 * 2
    assert (saved["train"]["global_batch_size"], saved["train"]["seq_len"]) == (2, 64)


def test_a_stage_change_inside_one_run_takes_the_resumed_stages_steps(stage_1, one_process, tmp_path):
    """One uninterrupted run whose second data stage starts at step 4 at seq_len 64 trains on exactly the losses of
    stage 1 then its resume at seq_len 64 (one process: bitwise, measured), and so does it under cp2 (measured:
    within 9.5e-7 of one process): the stage's data continues at the same global sample, its global batch is
    kept in sequences, and the RoPE table of the longer stage gives the first stage's positions the same rows."""
    config = tmp_path / "stages.toml"
    config.write_text('[[training.data_stages]]\nname = "short"\n[[training.data_stages]]\nname = "long"\n'
                      "start_step = 4\nseq_len = 64\n")  # fmt: skip
    args = ["--job.config_file", str(config), *TINY, *CONSTANT_LR, "--training.steps", "8"]
    args += ["--training.global_batch_size", "4"]  # TINY's one process's; cp2 has one DP rank too
    straight = train_and_read_metrics(args, 1, tmp_path / "one")
    before = [json.loads(line) for line in (stage_1 / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in straight] == [r["loss"] for r in before + one_process]
    assert [r["data_stage"] for r in straight] == [1] * 4 + [2] * 4
    cp2 = train_and_read_metrics([*args, *CP2], 2, tmp_path / "cp2")
    assert [r["loss"] for r in cp2] == pytest.approx([r["loss"] for r in straight], abs=LOSS_ATOL)
