"""bench/gpu.sh, the prepared device call: its two frameworks get the same run, and its smoke mode (the
offline install from bench/wheels, torchpre's dry run of the real 1B shape, torchtitan's check of the
same shape, a tiny torchpre run) passes on CPU."""

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import gpu_compare
from bench.gpu_compare import DEEPSEEK_V3_ROW, ROWS, TWO_GPU_ROWS, Row, titan_command, torchpre_command
from tests.launch import REPO, WORKER_ENV, run_entry
from torchpre.models.llama3.args import LLAMA3_FLAVORS
from torchpre.models.llama3.model import Transformer


def _flags(command: list[str]) -> dict[str, str]:
    """`--key value` pairs of a command line; flags without a value map to ''."""
    flags, key = {}, None
    for token in command:
        if token.startswith("--"):
            key, flags[token] = token, ""
        elif key is not None:
            flags[key], key = token, None
    return flags


LLAMA_ROWS = [row for row in (*ROWS, *TWO_GPU_ROWS) if row.model == "llama3"]


@pytest.mark.parametrize("row", LLAMA_ROWS, ids=lambda row: row.label)
def test_both_frameworks_get_the_same_run(row, tmp_path):
    theirs_command = titan_command(row, 15, tmp_path)
    if row.fp8 == "tensorwise":  # torchtitan 0.3.0 has no tensorwise float8 recipe: torchpre runs the row alone
        assert theirs_command is None
        return
    ours, theirs = _flags(torchpre_command(row, 15, tmp_path)), _flags(theirs_command)
    for key in ("--training.seq_len", "--training.local_batch_size", "--training.steps",
                "--training.mixed_precision_param", "--lr_scheduler.warmup_steps", "--metrics.log_freq"):
        assert ours[key] == theirs[key], key
    assert theirs["--module"] == "bench.titan_llama"
    untied = "_untied" if row.nproc > 1 else ""  # FSDP over two GPUs: torchtitan untied
    float8 = f"_float8_{row.fp8}" if row.fp8 else ""
    assert theirs["--config"] == f"torchpre_{ours['--model.flavor']}{untied}{float8}"
    cp = ours.get("--parallelism.context_parallel_degree", "1")
    assert cp == theirs.get("--parallelism.context_parallel_degree", "1") == str(row.cp)
    dp = row.nproc // row.cp
    assert int(theirs["--training.global_batch_size"]) == int(ours["--training.local_batch_size"]) * dp
    assert ours["--model.vocab_size"] == "128256" and ours["--training.dataset"] == "synthetic"
    assert ("--compile.enable" in ours) == ("--compile.enable" in theirs) == row.compile
    assert theirs_command[-1] == "activation-checkpoint:none"  # torchpre's default; torchtitan's is selective
    if row.fp8:  # float8 blocks; torchpre never converts the output layer, torchtitan's config filters it out
        assert (ours["--quantize.linear"], ours["--quantize.recipe"]) == ("float8", row.fp8)
    else:
        assert "--quantize.linear" not in ours


def test_the_deepseek_v3_row_is_torchpres_alone_with_mla_experts_and_mtp(tmp_path):
    """Issue 38's row: the 2B flavor (MLA, 64 fine-grained experts), one multi-token prediction depth, DeepSeek-V3's
    vocabulary, compiled bf16 on one GPU; torchtitan gets no command (its deepseek_v3 has its own flavors)."""
    assert DEEPSEEK_V3_ROW in ROWS and titan_command(DEEPSEEK_V3_ROW, 15, tmp_path) is None
    assert [row for row in ROWS if row.model != "llama3"] == [DEEPSEEK_V3_ROW]
    ours = _flags(torchpre_command(DEEPSEEK_V3_ROW, 15, tmp_path))
    assert (ours["--model.name"], ours["--model.flavor"], ours["--model.mtp_depth"]) == ("deepseek_v3", "2B", "1")
    assert ours["--model.vocab_size"] == "129280" and ours["--training.mixed_precision_param"] == "bfloat16"
    assert "--compile.enable" in ours and DEEPSEEK_V3_ROW.label == "deepseek_v3 2B mtp1 seq 4096 batch 2 compiled 1 GPU"


def test_a_row_torchtitan_does_not_run_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_compare, "run", _fake_run({"torchpre": 1000.0}))
    monkeypatch.setattr(gpu_compare, "peak_flops", lambda device, linear="none": (1e15, "bf16"))
    cells = gpu_compare.measure(DEEPSEEK_V3_ROW, 15, tmp_path / "work", tmp_path, timeout_s=60)
    mfu = 1000.0 * gpu_compare.flops_of(DEEPSEEK_V3_ROW) / 1e15
    assert cells == [DEEPSEEK_V3_ROW.label, "1,000", f"{mfu:.1%}", "15.0", "not run", "", "", ""]


@pytest.mark.slow
def test_the_deepseek_v3_row_fits_an_h200_by_the_dry_run(tmp_path):
    """The smoke's dry run of the row's real shape (eager, on meta) fits an H200: 89.0 GiB of tensors, 104 of the
    allocator's 139.4 (measured; 4 sequences per step would need 138.8 GiB of tensors, so the row runs 2)."""
    command = torchpre_command(dataclasses.replace(DEEPSEEK_V3_ROW, compile=False), 15, tmp_path)
    dry_run = ["--job.dry_run", "--job.dry_run_gpu", "h200-141gb", "--job.dry_run_world_size", "1"]
    result = run_entry("train.py", [*command[command.index("train.py") + 1 :], *dry_run])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2,334,628,608 parameters" in result.stdout  # 2B with its MTP depth


@pytest.mark.slow
def test_the_smoke_trains_the_deepseek_v3_flags_on_a_tiny_model(tmp_path):
    """The DeepSeek-V3 row's flags (MTP, the 129,280-id vocabulary, bf16, synthetic tokens) train 2 steps of the
    debug model on this CPU, its experts as bf16 grouped matmuls, as the smoke runs them."""
    row = Row(gpu_compare.TINY_FLAVORS["deepseek_v3"], 32, 2, compile=False, model="deepseek_v3", mtp_depth=1)
    command = torchpre_command(row, 2, tmp_path)
    result = run_entry("train.py", command[command.index("train.py") + 1 :])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["loss/mtp_1"]) for r in records)


def test_fp8_rows_sit_beside_their_bf16_rows():
    """1B and 3B, rowwise and tensorwise, compiled: each FP8 row is a bf16 row's run with float8 linears, and its
    MFU is taken against the FP8 peak."""
    fp8 = [row for row in ROWS if row.fp8]
    assert {(row.flavor, row.fp8) for row in fp8} == {(f, r) for f in ("1B", "3B") for r in ("rowwise", "tensorwise")}
    for row in fp8:
        assert row.compile and dataclasses.replace(row, fp8="") in ROWS
        assert row.label.endswith(f"fp8 {row.fp8}")
    assert gpu_compare.selected(list(ROWS), "fp8") == fp8


WHEELS = REPO / "bench" / "wheels"
needs_wheels = pytest.mark.skipif(not WHEELS.is_dir(), reason="run bash bench/prepare_gpu_wheels.sh first")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """bench/wheels installed offline, as bench/gpu.sh installs them on the GPU machine."""
    folder = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--target", str(folder),
         "--find-links", str(WHEELS), "torchtitan", "torchdata", "tyro", "docstring-parser", "typeguard",
         "typing-extensions", "spmd-types", "torch-checkpointing"],
        check=True, capture_output=True,
    )  # fmt: skip
    return folder


@pytest.mark.slow
@needs_wheels
def test_smoke_mode_installs_offline_and_checks_the_first_row(tmp_path):
    env = {**os.environ, **WORKER_ENV, "GPU_BENCH_SMOKE": "1", "PYTHON": sys.executable,
           "GPU_BENCH_SITE": str(tmp_path / "site"), "OUT": str(tmp_path / "out")}  # fmt: skip
    result = subprocess.run(
        ["bash", "bench/gpu.sh", "--max-rows", "1", "--work", str(tmp_path / "work")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "torchtitan 0.3.0" in result.stdout
    row = ROWS[0].label
    assert f"smoke {row}: torchpre dry run ok" in result.stdout
    assert f"smoke {row}: torchtitan check ok" in result.stdout
    for flags in ("bf16", "fp8 rowwise", "fp8 tensorwise", "deepseek_v3 mtp1 bf16"):
        assert f"torchpre trains 2 steps with the {flags} flags on a tiny model: ok" in result.stdout


def test_the_smoke_trains_once_per_family_and_precision_of_the_rows(tmp_path, monkeypatch):
    """Without a GPU the FP8 and DeepSeek-V3 rows are checked by training: the smoke runs a tiny model once with
    each family's and precision's flags (Llama 3 in bf16, float8 rowwise and tensorwise; DeepSeek-V3 with MTP in bf16)
    and reports each."""
    commands = []
    monkeypatch.setattr(gpu_compare, "run", lambda command, timeout_s, log: commands.append(command) or True)
    assert gpu_compare.smoke_train(tmp_path, tmp_path / "gpu_log.txt") == 0
    runs = [
        (flags.get("--model.name", "llama3"), flags["--model.flavor"], flags.get("--model.mtp_depth", "0"),
         flags.get("--quantize.recipe", "bf16"))
        for flags in map(_flags, commands)
    ]  # fmt: skip
    assert runs == [("llama3", "tiny", "0", "bf16"), ("deepseek_v3", "debugmodel", "1", "bf16"),
                    ("llama3", "tiny", "0", "rowwise"), ("llama3", "tiny", "0", "tensorwise")]  # fmt: skip


@pytest.mark.slow
def test_the_smoke_trains_the_fp8_flags_on_a_tiny_model(tmp_path):
    """The FP8 rows' torchpre flags train 2 steps of the tiny model on this CPU (emulated float8, the 128,256-id
    vocabulary, synthetic tokens, bf16), as the smoke runs them (here through the test suite's warm fork server)."""
    for recipe in ("rowwise", "tensorwise"):
        folder = tmp_path / recipe
        command = torchpre_command(Row("tiny", 32, 2, compile=False, fp8=recipe), 2, folder)
        result = run_entry("train.py", command[command.index("train.py") + 1 :])
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert f"linears in float8 ({recipe})" in result.stdout and "emulated matmuls" in result.stdout
        records = [json.loads(line) for line in (folder / "metrics.jsonl").open()]
        assert [r["step"] for r in records] == [1, 2] and all(math.isfinite(r["loss"]) for r in records)


@pytest.mark.slow
@needs_wheels
@pytest.mark.parametrize("flavor", ["tiny", "debugmodel_tied"])
def test_torchtitans_trainer_runs_the_benchmarks_config_on_cpu(site, tmp_path, flavor):
    """torchtitan's real Trainer and loop with bench/titan_llama.py's config (torchpre's flavor, untied and tied;
    synthetic tokens, metrics.jsonl) and the command line bench/gpu.sh gives it, on CPU (tests/bench/titan_on_cpu.py
    in place of `-m torchtitan.train`)."""
    command = titan_command(Row(flavor, 32, 2, compile=False), 8, tmp_path)
    at = command.index("torchtitan.train")
    command[at - 1 : at + 1] = ["tests/bench/titan_on_cpu.py"]
    env = {**os.environ, **WORKER_ENV, "PYTHONPATH": f"{REPO}:{site}"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with torch.device("meta"):
        model = Transformer(LLAMA3_FLAVORS[flavor])
    count = sum(p.numel() for p in model.parameters())
    assert f"size: {count:,} total parameters" in result.stdout + result.stderr  # tied or not, as the flavor is
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    # Random labels: the expected cross-entropy is ln(vocab) plus the model's distance from uniform, so at
    # least ln(2048) = 7.62 up to the noise of 64 tokens; a fresh untied model's logits add well under 2 nats, a
    # tied one's up to 5 (each position's own token gets the largest logit: 11.6 to 11.9 measured here).
    assert all(r["tokens_per_sec"] > 0 for r in records)
    excess = 5 if LLAMA3_FLAVORS[flavor].tie_word_embeddings else 2
    assert math.log(2048) - 0.3 < min(r["loss"] for r in records) and records[0]["loss"] < math.log(2048) + excess


def _fake_run(rates: dict[str, float]):
    """Stands in for a training job: writes a metrics.jsonl of 15 steps into the job's dump folder, the
    first 5 slow (compilation), then the framework's steady rate."""

    def run(command: list[str], timeout_s: float, log) -> bool:
        name = "torchpre" if "train.py" in command else "torchtitan"
        folder = Path(command[command.index("--job.dump_folder" if name == "torchpre" else "--dump_folder") + 1])
        key = "tokens_per_sec_per_device" if name == "torchpre" else "tokens_per_sec"
        folder.mkdir(parents=True)
        records = [{"step": step, key: 10.0 if step <= 5 else rates[name], "max_memory_bytes": step * 2**30}
                   for step in range(1, 16)]  # fmt: skip
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        return True

    return run


def test_a_row_reports_steady_rates_mfu_memory_and_the_ratio(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_compare, "run", _fake_run({"torchpre": 1100.0, "torchtitan": 1000.0}))
    monkeypatch.setattr(gpu_compare, "peak_flops", lambda device, linear="none": (1e15, "bf16"))
    row = ROWS[0]
    cells = gpu_compare.measure(row, 15, tmp_path / "work", tmp_path, timeout_s=60)
    mfu = 1100.0 * gpu_compare.flops_of(row) / 1e15
    assert cells == [row.label, "1,100", f"{mfu:.1%}", "15.0", "1,000", f"{mfu / 1.1:.1%}", "15.0", "1.10x"]
    raw = [json.loads(line) for line in (tmp_path / "gpu_raw.jsonl").read_text().splitlines()]
    assert len(raw) == 30 and {r["framework"] for r in raw} == {"torchpre", "torchtitan"}


def test_the_long_context_rows_fit_one_sequence_per_step():
    """The 32K row: one sequence on one GPU, and the same sequence split over two cp ranks when two are present."""
    long_rows = [row for row in (*ROWS, *TWO_GPU_ROWS) if row.seq_len == 32768]
    assert [(row.nproc, row.cp, row.local_batch) for row in long_rows] == [(1, 1, 1), (2, 2, 1)]
    assert long_rows[1].label.endswith("2 GPU cp2")


def test_the_flop_count_is_torchpres_for_the_real_1b():
    # 6 x (1,235,814,400 parameters, the tied table counted once as the output projection) + 12 x 16 x 2048 x 4096
    assert gpu_compare.flops_of(ROWS[0]) == 6 * 1_235_814_400 + 12 * 16 * 2048 * 4096


def test_rows_past_the_budget_are_skipped_and_named(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_compare, "run", _fake_run({"torchpre": 1.0, "torchtitan": 1.0}))
    monkeypatch.setattr(gpu_compare, "peak_flops", lambda device, linear="none": (1e15, "bf16"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "fake GPU")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    args = argparse.Namespace(out=tmp_path, work=tmp_path / "work", steps=15, budget_s=100.0, only="")
    gpu_compare.benchmark(args)  # the eager guess (90 s) fits, the compiled one (200 s) does not
    table = (tmp_path / "gpu_table.md").read_text()
    ran = [line.split(" | ")[0].strip("| ") for line in table.splitlines()[2:] if line.startswith("| ")]
    assert ran == [row.label for row in ROWS if not row.compile]
    assert f"Skipped for the time budget: {', '.join(r.label for r in ROWS if r.compile)}." in table
