"""FP8 in MFU, the dry run's counts and the planner: which peak, which FLOPs run at it, what backward keeps."""

import dataclasses
import logging

import pytest
import torch
from torch import nn

from torchpre.config.job_config import JobConfig
from torchpre.config.parser import parse_args
from torchpre.metrics import flops
from torchpre.metrics.logger import format_step_line
from torchpre.planner.activation_probe import probe_microbatch
from torchpre.planner.hardware import get_hardware
from torchpre.planner.layout_space import Layout, check
from torchpre.planner.predict import model_flops_per_token, predict
from torchpre.planner.stage_costs import microbatch_pieces
from torchpre.planner.time_model import Work, compute_seconds

pytest.importorskip("torchao")


@pytest.fixture(autouse=True)
def quiet():
    logging.getLogger("torchpre").setLevel(logging.WARNING)
    yield
    logging.getLogger("torchpre").setLevel(logging.INFO)


@pytest.mark.parametrize(
    "gpu, linear, expected",
    [
        ("NVIDIA H100 80GB HBM3", "float8", (1979e12, "fp8")),
        ("NVIDIA H100 80GB HBM3", "none", (989e12, "bf16")),
        ("NVIDIA H200", "mxfp8", (1979e12, "fp8")),
        ("NVIDIA H100 PCIe", "float8", (1513e12, "fp8")),
        ("NVIDIA B200", "float8", (4500e12, "fp8")),
        ("NVIDIA A100-SXM4-80GB", "float8", (312e12, "bf16")),  # no FP8 tensor cores: emulated, bf16's peak
    ],
)
def test_mfu_divides_by_the_fp8_peak_when_the_linears_are_fp8(monkeypatch, gpu, linear, expected):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu)
    assert flops.peak_flops(torch.device("cuda"), 0.0, linear) == expected
    assert flops.peak_flops(torch.device("cuda"), 5e14, linear) == (5e14, "configured")


def test_the_step_line_names_the_peak():
    record = {"step": 1, "loss": 5.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_sec": 100.0, "mfu": 0.41,
              "max_memory_bytes": 0, "step_time_s": 1.0, "data_time_s": 0.0}  # fmt: skip
    assert "| mfu 41.0% |" in format_step_line(record)
    assert "| mfu 41.0% of the fp8 peak |" in format_step_line({**record, "mfu_peak": "fp8"})


def test_fp8_matmuls_run_at_the_fp8_peak():
    """1e12 FLOPs, 6e11 of them FP8, at 60%: 4e11 / 6e14 + 6e11 / 1.2e15 = 0.667 + 0.5 ms; without FP8 tensor cores
    all at the bf16 rate (1.667 ms)."""
    h100 = dataclasses.replace(get_hardware("h100-80gb"), matmul_efficiency=0.6)
    work = Work(1e12, fp8_flops=6e11)
    assert compute_seconds(work, h100) == pytest.approx(4e11 / (989e12 * 0.6) + 6e11 / (1979e12 * 0.6))
    assert compute_seconds(work, dataclasses.replace(h100, fp8_peak_flops=0.0)) == pytest.approx(1e12 / (989e12 * 0.6))


def _float8_linear(recipe: str) -> nn.Module:
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    with torch.device("meta"):
        linear = nn.Linear(64, 128, bias=False)
    return Float8Linear.from_float(linear, config=Float8LinearConfig.from_recipe_name(recipe))


class _Doubled(nn.Module):
    """x -> linear(2x): the linear's input is made inside the probe, so what backward keeps of it is counted."""

    def __init__(self, linear: nn.Module):
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(2 * x)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_keeps_its_input_in_high_precision_for_backward(recipe):
    """torchao's `matmul_with_hp_or_float8_args` saves the high-precision input and weight and casts them again
    in backward, so an FP8 linear keeps what nn.Linear keeps: its bf16 input (4 x 32 x 64 x 2 B = 16 KiB, not 8 KiB
    of FP8) and the output the probe holds (4 x 32 x 128 x 2 B); its three matmuls (forward, grad input, grad
    weight: 3 x 2 x 128 x 64 x 128 FLOPs) are `_scaled_mm`, the FLOPs that run at the FP8 peak."""
    x = torch.empty(4, 32, 64, dtype=torch.bfloat16, device="meta", requires_grad=True)
    with torch.device("meta"):
        plain = nn.Linear(64, 128, bias=False, dtype=torch.bfloat16)
    fp8 = probe_microbatch(_Doubled(_float8_linear(recipe).to(torch.bfloat16)), (x,), devices=("meta",))
    reference = probe_microbatch(_Doubled(plain), (x,), devices=("meta",))
    assert fp8.saved_bytes == reference.saved_bytes == 4 * 32 * 64 * 2 + 4 * 32 * 128 * 2
    assert fp8.fp8_flops == fp8.matmul_flops == reference.matmul_flops == 3 * 2 * 128 * 64 * 128
    assert reference.fp8_flops == 0


def _predict_config(linear: str) -> JobConfig:
    return parse_args(JobConfig, ["--model.flavor", "debugmodel", "--training.global_batch_size", "16",
                                  "--training.mixed_precision_param", "bfloat16", "--quantize.linear", linear])


def _predict(linear: str):
    checked = check(Layout(dp=2, tp=1, pp=1, zero_stage=1), _predict_config(linear), 2)
    flops_per_token = model_flops_per_token(checked.config, checked.model_args)
    return predict(checked, get_hardware("h100-80gb"), 2, flops_per_token)


def test_the_planner_times_float8_linears_at_the_fp8_peak():
    """The debug model's block linears are FP8 (dim 256: multiples of 16), its output layer and attention are not:
    their matmul FLOPs move to the FP8 rate, and MFU is against the FP8 peak. (Eager torchao adds casts and amax
    reductions, memory-bound work the model counts too, which dominates at this tiny size.)"""
    bf16, fp8 = _predict("none"), _predict("float8")
    assert (bf16.mfu_peak, fp8.mfu_peak) == ("bf16", "fp8")
    assert bf16.as_dict()["mfu_peak"] == "bf16"
    assert fp8.step.compute_s > 0 and bf16.step.compute_s > 0
    blocks = {linear: microbatch_pieces(_predict_config(linear), 1).block for linear in ("none", "float8")}
    assert blocks["none"].forward.fp8_flops == 0
    assert blocks["float8"].forward.flops == blocks["none"].forward.flops  # the same FLOPs, some at the FP8 rate
    assert 0 < blocks["float8"].forward.fp8_flops < blocks["float8"].forward.flops  # attention stays bf16
    assert fp8.mfu == pytest.approx(fp8.flops_per_token * fp8.tokens_per_sec / (2 * 1979e12))


def test_an_mxfp8_dry_run_traces_the_emulated_linears():
    """MXFP8's casts are triton kernels, which meta tensors cannot run (torchao's `needs triton`): the dry run and
    the planner trace the emulated ops, which keep the same saved bytes as bf16 (measured equal) and count their
    matmuls at the bf16 rate, not the FP8 peak."""
    blocks = {linear: microbatch_pieces(_predict_config(linear), 1).block for linear in ("none", "mxfp8")}
    assert blocks["mxfp8"].saved_bytes == blocks["none"].saved_bytes
    assert blocks["mxfp8"].forward.flops == blocks["none"].forward.flops
    assert blocks["mxfp8"].forward.fp8_flops == 0
