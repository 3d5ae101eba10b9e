"""Checkpoints: exact resume, resharding to other layouts, atomic folders, async saves, errors."""

import json
import shutil

import pytest
import torch

from tests.launch import DEBUG as DEBUG_MODEL
from tests.launch import TINY, read_checkpoint, run_train, train_and_read_metrics
from torchpre.checkpoint.integrity import MANIFEST, verify_share

pytestmark = pytest.mark.slow

CKPT = ["--checkpoint.enable", "--checkpoint.interval", "5"]


def losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records]


def resume(folder, args: list[str], nproc: int, from_step: int) -> list[dict]:
    """Deletes the checkpoints after `from_step` and the metrics, reruns, returns the new records."""
    records, _ = resume_with_log(folder, args, nproc, from_step)
    return records


def resume_with_log(folder, args: list[str], nproc: int, from_step: int) -> tuple[list[dict], str]:
    """`resume`, and the job's log."""
    for step_dir in (folder / "checkpoint").glob("step-*"):
        if int(step_dir.name.split("-")[1]) > from_step:
            shutil.rmtree(step_dir)
    (folder / "metrics.jsonl").unlink()
    result = run_train(args, nproc, folder)
    assert result.returncode == 0, f"training failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return read_metrics(folder), result.stdout


def read_metrics(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_resume_is_bitwise_exact(tmp_path):
    """10 steps + resume + 10 steps gives exactly the losses of 20 steps straight: fp32 on CPU is
    deterministic, and the checkpoint restores weights, AdamW moments and step, the lr, the data
    position and the RNG. The resumed job never draws the weights it loads (tests/unit/test_startup.py
    shows the state equals that of a job that did)."""
    args = [*TINY, *CKPT, "--checkpoint.interval", "10", "--training.steps", "20"]
    straight = train_and_read_metrics(args, 1, tmp_path)
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-10", "step-20"]
    resumed, log = resume_with_log(tmp_path, args, 1, from_step=10)
    assert f"skipped weight initialisation: loading {tmp_path / 'checkpoint' / 'step-10'}" in log
    assert [r["step"] for r in resumed] == list(range(11, 21))
    assert losses(resumed) == losses(straight)[10:]
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in straight][10:]
    assert [r["lr"] for r in resumed] == [r["lr"] for r in straight][10:]


DEBUG = [*DEBUG_MODEL, "--training.steps", "10"]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
DP2 = ["--training.local_batch_size", "4"]
ONE = ["--training.local_batch_size", "8"]


def pp2(schedule: str, *extra: str) -> list[str]:
    return ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", schedule, *extra]


RESHARDS = {
    "1proc_to_dp2": ((1, ONE), (2, DP2)),
    "dp2_zero1_to_tp2": ((2, [*DP2, "--optimizer.zero_stage", "1"]), (2, [*ONE, *TP2])),
    "pp2_1f1b_to_dp2_tp2": ((2, [*ONE, *pp2("1F1B")]), (4, [*DP2, *TP2, "--parallelism.enable_sequence_parallel"])),
    "dp2_tp2_pp2_to_1proc": ((8, [*DP2, *TP2, *pp2("1F1B"), "--optimizer.zero_stage", "1"]), (1, ONE)),
    "tp2_to_pp2_interleaved": (
        (2, [*ONE, *TP2]),
        (2, [*ONE, *pp2("Interleaved1F1B", "--parallelism.pipeline_parallel_virtual_stages", "2")]),
    ),
}
# Resharding changes only reduction order (as in the parity tests), so the same tolerance.
LOSS_ATOL = 1e-4


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    return train_and_read_metrics([*DEBUG, *ONE], 1, tmp_path_factory.mktemp("reference"))


@pytest.mark.parametrize("case", RESHARDS)
def test_checkpoint_reshards_to_another_layout(case, reference, tmp_path):
    (save_nproc, save_args), (load_nproc, load_args) = RESHARDS[case]
    train_and_read_metrics([*DEBUG, *CKPT, *save_args], save_nproc, tmp_path)
    resumed = resume(tmp_path, [*DEBUG, *CKPT, *load_args], load_nproc, from_step=5)
    assert [r["step"] for r in resumed] == list(range(6, 11))
    assert losses(resumed) == pytest.approx(losses(reference)[5:], abs=LOSS_ATOL)


def test_unfinished_save_is_ignored_and_retention_keeps_k(tmp_path):
    args = [*TINY, *CKPT, "--checkpoint.interval", "2", "--training.steps", "6", "--checkpoint.keep_latest_k", "2"]
    train_and_read_metrics(args, 1, tmp_path)
    folder = tmp_path / "checkpoint"
    assert sorted(p.name for p in folder.iterdir()) == ["step-4", "step-6"]
    # A run killed while writing step 8 leaves only its temporary folder, which never counts.
    shutil.copytree(folder / "step-6", folder / ".tmp-step-8")
    (folder / ".tmp-step-8" / ".metadata").unlink()
    result = run_train([*args, "--training.steps", "8"], 1, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "loaded " + str(folder / "step-6") in result.stdout
    assert sorted(p.name for p in folder.iterdir()) == ["step-6", "step-8"]




def test_async_and_sync_saves_hold_the_same_state(tmp_path):
    """Saved at step 5 of 10, so the run goes on updating the live tensors while the async save is written: a
    stager that kept references to them instead of copies would write later values into step 5. The same for a
    write in a thread ("async") and in DCP's checkpoint process ("async_process")."""
    args = [*TINY, *CKPT, "--training.steps", "10", "--training.global_batch_size", "8"]
    args += ["--training.local_batch_size", "2"]
    straight = train_and_read_metrics(args, 2, tmp_path / "sync")
    flat_sync = _flatten(read_checkpoint(tmp_path / "sync" / "checkpoint" / "step-5"))
    assert any(key.startswith("optimizer.") and key.endswith("exp_avg") for key in flat_sync)
    for mode in ("async", "async_process"):
        asynchronous_args = [*args, "--checkpoint.async_mode", mode]
        train_and_read_metrics(asynchronous_args, 2, tmp_path / mode)
        flat_async = _flatten(read_checkpoint(tmp_path / mode / "checkpoint" / "step-5"))
        assert flat_sync.keys() == flat_async.keys()
        for key, value in flat_sync.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, flat_async[key]), (mode, key)
            elif not key.startswith("rng"):
                assert value == flat_async[key], (mode, key)
        resumed = resume(tmp_path / mode, asynchronous_args, 2, from_step=5)
        assert [r["step"] for r in resumed] == list(range(6, 11))
        assert losses(resumed) == losses(straight)[5:]  # same layout, fp32 on CPU: bitwise, as the exact-resume test
    for run in ("sync", "async", "async_process"):  # the manifest lists every file, each with its size and CRC
        step_dir = tmp_path / run / "checkpoint" / "step-5"
        manifest = json.loads((step_dir / MANIFEST).read_text())["files"]
        assert set(manifest) == {path.name for path in step_dir.iterdir()} - {MANIFEST}
        assert verify_share(step_dir, rank=0, world_size=1) == []


def _flatten(state: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in state.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def test_a_gelu_models_checkpoint_reshards_and_is_refused_by_a_swiglu_model(tmp_path):
    """model.mlp = 'gelu' saved under tp2 + SP at step 5 resumes on one process with the losses of one process's
    uninterrupted run (to the reshard tolerance); the same checkpoint resumed as the SwiGLU model names the tensors
    it lacks and holds."""
    gelu = [*DEBUG, *ONE, "--model.mlp", "gelu"]
    straight = train_and_read_metrics(gelu, 1, tmp_path / "straight")
    train_and_read_metrics([*gelu, *CKPT, *TP2, "--parallelism.enable_sequence_parallel"], 2, tmp_path / "run")
    resumed = resume(tmp_path / "run", [*gelu, *CKPT], 1, from_step=5)
    assert [r["step"] for r in resumed] == list(range(6, 11))
    assert losses(resumed) == pytest.approx(losses(straight)[5:], abs=LOSS_ATOL)
    result = run_train([*DEBUG, *ONE, *CKPT], 1, tmp_path / "run", timeout=120)
    assert result.returncode != 0
    assert "does not fit this model" in result.stderr and "feed_forward.w3.weight" in result.stderr


def test_loading_into_another_model_names_the_mismatched_tensors(tmp_path):
    train_and_read_metrics([*TINY, *CKPT, "--training.steps", "5"], 1, tmp_path)
    result = run_train([*TINY, *CKPT, "--training.steps", "6", "--model.flavor", "debugmodel"], 1, tmp_path, timeout=60)
    assert result.returncode != 0
    assert "does not fit this model" in result.stderr
    assert "model.tok_embeddings.weight: checkpoint (2048, 64) vs model (2048, 256)" in result.stderr


def test_initial_load_path_starts_a_new_run_from_weights(tmp_path):
    first = train_and_read_metrics([*TINY, *CKPT, "--training.steps", "10"], 1, tmp_path / "first")
    step_dir = tmp_path / "first/checkpoint/step-10"
    result = run_train([*TINY, "--training.steps", "3", "--checkpoint.initial_load_path", str(step_dir)], 1,
                       tmp_path / "second")
    assert result.returncode == 0, result.stderr
    assert f"skipped weight initialisation: loading {step_dir}" in result.stdout
    records = read_metrics(tmp_path / "second")
    # a new run (step 1, fresh optimizer, data from the start) on the trained weights: its first
    # loss is far below an untrained model's (~8.0) and close to where the first run ended
    assert records[0]["step"] == 1
    assert records[0]["loss"] < first[0]["loss"] - 0.05


def test_model_only_saves_weights_and_resuming_restarts_the_rest(tmp_path):
    train_and_read_metrics([*TINY, *CKPT, "--training.steps", "5", "--checkpoint.model_only"], 1, tmp_path)
    saved = read_checkpoint(tmp_path / "checkpoint" / "step-5")
    assert set(saved) == {"model"}
    (tmp_path / "metrics.jsonl").unlink()
    records = train_and_read_metrics([*TINY, *CKPT, "--training.steps", "2", "--checkpoint.interval", "9"], 1, tmp_path)
    assert [r["step"] for r in records] == [1, 2]  # no step in the checkpoint: the run starts over


def test_excluded_parts_are_not_loaded(tmp_path):
    train_and_read_metrics([*TINY, *CKPT, "--training.steps", "5"], 1, tmp_path)
    (tmp_path / "metrics.jsonl").unlink()
    args = [*TINY, *CKPT, "--training.steps", "6", "--checkpoint.exclude_from_loading", "optimizer,dataloader"]
    result = run_train(args, 1, tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"loaded {tmp_path / 'checkpoint' / 'step-5'}: health, lr_scheduler, model, rng, train" in result.stdout
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [6]
