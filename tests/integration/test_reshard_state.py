"""Resharded resumes keep the whole training state: tied embeddings moved into pipeline stages, a parameter
dtype changed between save and load, and a checkpoint that lacks keys the job asks for.

Each resume runs tests/reshard_worker.py, which compares the loaded state with the checkpoint bitwise
(`torchpre.checkpoint.roundtrip`) before training on.
"""

import json
import pickle
import shutil
from pathlib import Path

import pytest

from tests.launch import manifest_record, run_train, train_and_read_metrics
from tests.reshard_worker import REPORT
from torchpre.checkpoint.integrity import MANIFEST
from torchpre.checkpoint.metadata_json import METADATA_JSON

pytestmark = pytest.mark.slow

WORKER = "tests/reshard_worker.py"
COMMON = [
    "--training.seq_len", "32",
    "--training.local_batch_size", "8",
    "--training.steps", "10",
    "--lr_scheduler.warmup_steps", "2",
    "--metrics.log_freq", "1",
    "--checkpoint.enable",
    "--checkpoint.interval", "5",
]
TIED = ["--model.flavor", "debugmodel_tied", *COMMON]
TINY = ["--model.flavor", "tiny", *COMMON]
BF16 = ["--training.mixed_precision_param", "bfloat16"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B"]
# fp32 on CPU: a resharded resume changes only the reduction order.
FP32_ATOL = 1e-4
# bf16 parameters: one layout's bf16 rounding against another's, measured at most 2.4e-4 here and over the
# reshard matrix; a state error (the tied output layer back at its initial weights) moves the loss far more.
BF16_ATOL = 1e-3


def losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records]


def resume(saved: Path, step: int, args: list[str], nproc: int, folder: Path) -> tuple[list[dict], dict]:
    """Copies step-`step` of the run in `saved` into `folder` and resumes it there with the worker: the
    records of the resumed steps and the round-trip report."""
    (folder / "checkpoint").mkdir(parents=True)
    shutil.copytree(saved / "checkpoint" / f"step-{step}", folder / "checkpoint" / f"step-{step}")
    records = train_and_read_metrics(args, nproc, folder, script=WORKER)
    return records, json.loads((folder / REPORT).read_text())


# bf16 (the longest, 90 s) with -m matrix: CI's reshard-matrix sample resumes tied bf16 Llama across pp layouts.
@pytest.mark.parametrize("dtype", ["fp32", pytest.param("bf16", marks=pytest.mark.matrix)])
def test_tied_embeddings_resume_inside_pipeline_stages(dtype, tmp_path):
    """Saved by one process (one Parameter for both tied names), resumed at pp2 (a copy per end stage): the
    last stage's copy gets the saved moments, step and master, so the resumed losses continue the
    uninterrupted run's; before, it restarted from zero moments (fp32) or its initial weights (bf16)."""
    extra, atol = (BF16, BF16_ATOL) if dtype == "bf16" else ([], FP32_ATOL)
    straight = train_and_read_metrics([*TIED, *extra], 1, tmp_path / "a")
    resumed, report = resume(tmp_path / "a", 5, [*TIED, *extra, *PP2], 2, tmp_path / "b")
    assert report["ok"], report["text"]
    assert [r["step"] for r in resumed] == list(range(6, 11))
    assert losses(resumed) == pytest.approx(losses(straight)[5:], abs=atol)


@pytest.mark.parametrize("saved, loaded", [("fp32", "bf16"), ("bf16", "fp32")])
def test_dtype_change_carries_the_fp32_values(saved, loaded, tmp_path):
    """bf16 -> fp32 takes the saved fp32 masters as the parameters; fp32 -> bf16 takes the saved fp32
    parameters as the masters (the round trip compares the fp32 values bitwise); neither goes through a
    bf16-rounded copy."""
    dtype = {"fp32": [], "bf16": BF16}
    train_and_read_metrics([*TINY, *dtype[saved], "--training.steps", "5"], 1, tmp_path / "a")
    _, report = resume(tmp_path / "a", 5, [*TINY, *dtype[loaded], "--training.steps", "6"], 1, tmp_path / "b")
    assert report["ok"], report["text"]
    assert report["compared"] > 0


# A global batch every layout splits evenly: 2 microbatches of 4 per rank at dp2, 4 of 4 at tp2 (dp1).
ZERO_COMMON = [*TINY[: TINY.index("--training.local_batch_size")], "--training.local_batch_size", "4",
               *TINY[TINY.index("--training.local_batch_size") + 2 :], "--training.global_batch_size", "16"]
ZERO_LAYOUTS = {  # name: (processes, flags)
    "zero3-dp2": (2, ["--optimizer.zero_stage", "3"]),
    "zero1-tp2": (2, ["--optimizer.zero_stage", "1", "--parallelism.tensor_parallel_degree", "2"]),
    "zero2-dp2xpp2": (4, ["--optimizer.zero_stage", "2", "--parallelism.pipeline_parallel_degree", "2"]),
}


@pytest.mark.parametrize(
    "save, load",
    [("zero3-dp2", "zero1-tp2"), pytest.param("zero1-tp2", "zero3-dp2", marks=pytest.mark.zero_matrix),
     pytest.param("zero3-dp2", "zero2-dp2xpp2", marks=pytest.mark.zero_matrix), ("zero2-dp2xpp2", "zero3-dp2")],
)
def test_zero3_checkpoints_reshard_to_other_stages(save, load, tmp_path, monkeypatch):
    """FSDP's sharded parameters and optimizer state (DTensors on the dp_shard mesh, no separate master) load
    into ZeRO-1 under TP and ZeRO-2 under PP, and back, bitwise, and training continues with the uninterrupted
    run's losses."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # FSDP on gloo with a visible GPU crashes (pytorch#132471)
    (save_procs, save_flags), (load_procs, load_flags) = ZERO_LAYOUTS[save], ZERO_LAYOUTS[load]
    straight = train_and_read_metrics([*ZERO_COMMON, *save_flags], save_procs, tmp_path / "a")
    resumed, report = resume(tmp_path / "a", 5, [*ZERO_COMMON, *load_flags], load_procs, tmp_path / "b")
    assert report["ok"], report["text"]
    assert report["compared"] > 0
    assert [r["step"] for r in resumed] == list(range(6, 11))
    assert losses(resumed) == pytest.approx(losses(straight)[5:], abs=FP32_ATOL)


def test_stages_holding_the_embedding_or_the_output_alone_reshard_to_one_process(tmp_path):
    """Saved at pp2 x 2 virtual stages with the embedding and the output counted as one layer each (the tiny model's
    4 stages: the embedding alone, a block, a block, the output alone), resumed by one process: the loaded state
    equals the checkpoint bitwise and training continues with the uninterrupted run's losses."""
    split = [*PP2[:2], "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
             "--parallelism.pipeline_parallel_virtual_stages", "2",
             "--parallelism.pipeline_parallel_embedding_layers", "1",
             "--parallelism.pipeline_parallel_output_layers", "1"]  # fmt: skip
    straight = train_and_read_metrics([*TINY, *split], 2, tmp_path / "a")
    resumed, report = resume(tmp_path / "a", 5, TINY, 1, tmp_path / "b")
    assert report["ok"], report["text"]
    assert report["compared"] > 0
    assert [r["step"] for r in resumed] == list(range(6, 11))
    assert losses(resumed) == pytest.approx(losses(straight)[5:], abs=FP32_ATOL)


def _drop_keys(step_dir: Path, prefix: str) -> list[str]:
    """Removes the entries starting with `prefix` from the checkpoint's metadata (metadata.json, which loads read,
    and the pickled .metadata alike), as a save under other names would have left them, and re-records both files in
    the manifest; returns the removed keys."""
    path, json_path = step_dir / ".metadata", step_dir / METADATA_JSON
    metadata, record = pickle.loads(path.read_bytes()), json.loads(json_path.read_text())
    dropped = sorted(key for key in metadata.state_dict_metadata if key.startswith(prefix))
    for key in dropped:
        del metadata.state_dict_metadata[key]
        del record["state_dict_metadata"][key]
    path.write_bytes(pickle.dumps(metadata))
    json_path.write_text(json.dumps(record))
    manifest = json.loads((step_dir / MANIFEST).read_text())
    manifest["files"][".metadata"], manifest["files"][METADATA_JSON] = manifest_record(path), manifest_record(json_path)
    (step_dir / MANIFEST).write_text(json.dumps(manifest))
    return dropped


def test_a_checkpoint_without_requested_keys_is_an_error(tmp_path):
    """Optimizer state the job needs but the checkpoint lacks stops the job (exit 2) naming a few of the keys,
    their count and the folder; before, those moments silently restarted from zero."""
    args = [*TINY, "--training.steps", "5"]
    train_and_read_metrics(args, 1, tmp_path)
    step_dir = tmp_path / "checkpoint" / "step-5"
    dropped = _drop_keys(step_dir, "optimizer.layers.1.")
    assert len(dropped) > 3
    result = run_train([*TINY, "--training.steps", "6"], 1, tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    assert str(step_dir) in result.stderr
    assert f"{len(dropped)} entries" in result.stderr
    assert dropped[0] in result.stderr
    assert "Traceback" not in result.stderr


def test_excluding_the_optimizer_loads_without_its_keys(tmp_path):
    """The same checkpoint loads once the optimizer is excluded on purpose: only requested parts must be whole."""
    train_and_read_metrics([*TINY, "--training.steps", "5"], 1, tmp_path)
    _drop_keys(tmp_path / "checkpoint" / "step-5", "optimizer.layers.1.")
    args = [*TINY, "--training.steps", "6", "--checkpoint.exclude_from_loading", "optimizer"]
    result = run_train(args, 1, tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
