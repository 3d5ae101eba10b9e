"""Low-precision training (quantize.*) on CPU, where torchao emulates FP8: it trains like full precision and bf16, and
its checkpoints hold only high-precision state, so a run turns FP8 on or off at a resume, under another layout.
Layout invariance under FP8: tests/distributed/test_parallel_parity.py, QUANTIZED_LAYOUTS."""

import json
import shutil
from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemReader

from tests.launch import DEBUG, TINY, run_train, train_and_read_metrics

pytestmark = pytest.mark.slow
pytest.importorskip("torchao")

STEPS = [*DEBUG, "--training.local_batch_size", "8", "--training.steps", "20"]
# Measured at step 20 of the debug model (fp32 parameters, emulated FP8): tensorwise 2.0e-3, rowwise 1.7e-3, mxfp8
# rowwise 1.9e-3 above the fp32 run, whose loss the 20 steps move by 0.32 (8.12 -> 7.80). FP8 rounds each matmul's
# inputs to 3 mantissa bits (~5% error per product, averaged over the sums), which slows training a little. The band,
# 3x the largest measured, is under 2% of what training moves the loss; a run that ignored the low-precision linears
# would be equal to fp32, hence the floor.
BAND, FLOOR = 6e-3, 1e-4
# Against the bf16 run (training.mixed_precision_param = bfloat16, the baseline FP8 replaces on a GPU), measured at
# step 20: tensorwise 1.6e-3, rowwise 1.3e-3, mxfp8 rowwise 1.5e-3 above it, while bf16 itself is 3.4e-4 from fp32.
# bf16 keeps 8 significant bits in every op, FP8 4 in the linears' inputs only, so FP8 descends a little slower.
# The band, 3x the largest measured, is 1.6% of what the 20 steps move the loss.
BF16_BAND = 5e-3


@pytest.fixture(scope="module")
def full_precision(tmp_path_factory) -> list[dict]:
    return train_and_read_metrics(STEPS, 1, tmp_path_factory.mktemp("fp32"))


@pytest.fixture(scope="module")
def bf16(tmp_path_factory) -> list[dict]:
    return train_and_read_metrics([*STEPS, "--training.mixed_precision_param", "bfloat16"], 1,
                                  tmp_path_factory.mktemp("bf16"))  # fmt: skip


@pytest.mark.parametrize("linear, recipe", [("float8", "tensorwise"), ("float8", "rowwise"), ("mxfp8", "rowwise")])
def test_low_precision_trains_like_full_precision(linear, recipe, full_precision, bf16, tmp_path):
    """The step-20 loss of an FP8 run within its measured band of the fp32 run (and not equal to it) and of the
    bf16 run."""
    records = train_and_read_metrics([*STEPS, "--quantize.linear", linear, "--quantize.recipe", recipe], 1, tmp_path)
    loss = records[-1]["loss"]
    assert FLOOR < abs(loss - full_precision[-1]["loss"]) < BAND, (loss, full_precision[-1]["loss"])
    assert abs(loss - bf16[-1]["loss"]) < BF16_BAND, (loss, bf16[-1]["loss"])


# MoE experts (quantize.experts): the MoE debug model, 20 steps at a learning rate that moves its loss by 0.19 (8.03 to
# 7.84). Measured at step 20: MXFP8 linears and experts 1.8e-3 above bf16 (2.3e-3 above fp32), and 8.6e-4 above the same
# run with the experts left in high precision (MXFP8 linears only: 1.4e-3 above fp32). Held to BF16_BAND of bf16, as the
# linears are, and at least EXPERTS_FLOOR (a quarter of the measured) from the run without them: a run that ignored
# quantize.experts would equal that one.
MOE_STEPS = [*DEBUG, "--model.name", "moe", "--training.local_batch_size", "8", "--training.steps", "20",
             "--optimizer.lr", "3e-3"]  # fmt: skip
MXFP8_LINEARS = ["--quantize.linear", "mxfp8", "--quantize.recipe", "rowwise"]
EXPERTS_FLOOR = 2e-4


def test_mxfp8_experts_train_like_bf16_and_unlike_experts_left_in_high_precision(tmp_path):
    bf16 = train_and_read_metrics([*MOE_STEPS, "--training.mixed_precision_param", "bfloat16"], 1, tmp_path / "bf16")
    linears = train_and_read_metrics([*MOE_STEPS, *MXFP8_LINEARS], 1, tmp_path / "linears")
    experts = train_and_read_metrics([*MOE_STEPS, *MXFP8_LINEARS, "--quantize.experts"], 1, tmp_path / "experts")
    loss = experts[-1]["loss"]
    assert abs(loss - bf16[-1]["loss"]) < BF16_BAND, (loss, bf16[-1]["loss"])
    assert abs(loss - linears[-1]["loss"]) > EXPERTS_FLOOR, (loss, linears[-1]["loss"])


FP8 = ["--quantize.linear", "float8", "--quantize.recipe", "tensorwise"]
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "4"]
DP2 = ["--training.local_batch_size", "2"]  # TINY's global batch of 4 over two ranks
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
MOE, EP2 = ["--model.name", "moe"], ["--parallelism.expert_parallel_degree", "2"]
MXFP8_EXPERTS = ["--quantize.linear", "mxfp8", "--quantize.recipe", "rowwise_with_gw_hp", "--quantize.experts"]
# What separates a resumed run from the straight one it is compared with: FP8 on in only one of them for steps 5-8,
# and the layout's reduction order. Measured: 8.0e-5 (FP8 off at the resume, dp2) and 1.05e-4 (FP8 on, tp2); held to 3x
# the larger. A resume that lost the saved weights would restart near the initial loss, about 0.1 above.
RESUME_ATOL = 3e-4


def model_entries(step_dir: Path) -> dict[str, tuple]:
    """Each model tensor a checkpoint holds, with its shape and dtype."""
    metadata = FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    return {k: (tuple(m.size), m.properties.dtype) for k, m in metadata.items() if k.startswith("model.")}


def test_an_fp8_checkpoint_holds_the_full_precision_tensors(tmp_path):
    """The same names, shapes and dtypes with FP8 on as off: no scales, no FP8 copies, nothing a run without FP8
    (or a conversion to Hugging Face) cannot read."""
    for name, quantize in (("on", FP8), ("off", [])):
        train_and_read_metrics([*TINY, *CKPT, "--training.steps", "4", *quantize], 1, tmp_path / name)
    on, off = (model_entries(tmp_path / name / "checkpoint" / "step-4") for name in ("on", "off"))
    assert on == off and on


@pytest.mark.parametrize(
    "saved, resumed",
    [
        pytest.param((1, FP8), (2, DP2), id="fp8_1proc_to_off_dp2"),
        pytest.param((1, []), (2, [*FP8, *TP2]), id="off_1proc_to_fp8_tp2"),
        pytest.param((1, [*MOE, *MXFP8_EXPERTS]), (2, [*MOE, *DP2, *EP2]), id="mxfp8_experts_1proc_to_off_ep2"),
    ],
)
def test_a_checkpoint_resumes_with_fp8_turned_on_or_off(saved, resumed, tmp_path):
    """A run saved with FP8 on (off) resumes with it off (on) under another layout and continues the saved run."""
    (save_nproc, save_args), (load_nproc, load_args) = saved, resumed
    args = [*TINY, *CKPT, "--training.steps", "8"]
    straight = train_and_read_metrics([*args, *save_args], save_nproc, tmp_path)
    shutil.rmtree(tmp_path / "checkpoint" / "step-8")
    (tmp_path / "metrics.jsonl").unlink()
    result = run_train([*args, *load_args], load_nproc, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"loading {tmp_path / 'checkpoint' / 'step-4'}" in result.stdout
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [5, 6, 7, 8]
    losses = [r["loss"] for r in records]
    assert losses == pytest.approx([r["loss"] for r in straight[4:]], abs=RESUME_ATOL)


def test_fp8_all_gather_trains_as_the_high_precision_gather(tmp_path):
    """dp2 ZeRO-3 with tensorwise FP8: gathering the weights in FP8 (their scale all-reduced over the shards first)
    gives the values that casting after a high-precision gather gives, so the losses are bitwise those of the run
    without it. An amax taken per shard would give each shard its own scale and change them."""
    args = [*TINY, *DP2, *FP8, "--training.steps", "6", "--optimizer.zero_stage", "3"]
    high_precision = train_and_read_metrics(args, 2, tmp_path / "hp")
    fp8 = train_and_read_metrics([*args, "--quantize.fsdp_float8_all_gather"], 2, tmp_path / "fp8")
    assert [(r["loss"], r["grad_norm"]) for r in fp8] == [(r["loss"], r["grad_norm"]) for r in high_precision]


# FP8 under activation checkpointing and compile, against the same FP8 run without them (tiny model, 3 steps). The
# recomputed forward casts the same values with the same scales, so checkpointing is exact (measured: equal); compile
# fuses the casts and reorders sums (measured within 1e-6). Compile costs a minute on 2 cores: opt-in.
COMPOSED = {
    "full_ac": ["--activation_checkpoint.mode", "full"],
    "selective_ac": ["--activation_checkpoint.mode", "selective"],
    "compile": ["--compile.enable"],
}
COMPOSED_ATOL = 1e-5
COMPOSED_ARGS = [*TINY, "--training.steps", "3", "--quantize.linear", "float8"]


@pytest.fixture(scope="module")
def fp8_reference(tmp_path_factory) -> list[dict]:
    return train_and_read_metrics(COMPOSED_ARGS, 1, tmp_path_factory.mktemp("fp8_reference"))


@pytest.mark.parametrize(
    "feature", [pytest.param(n, marks=pytest.mark.parity_matrix) if n == "compile" else n for n in COMPOSED]
)
def test_fp8_composes_with_activation_checkpointing_and_compile(feature, fp8_reference, tmp_path):
    records = train_and_read_metrics([*COMPOSED_ARGS, *COMPOSED[feature]], 1, tmp_path)
    reference = fp8_reference
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in reference], abs=COMPOSED_ATOL)
