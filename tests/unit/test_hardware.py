"""The hardware table and JSON profiles: rows hold the datasheet numbers, profiles round-trip, bad input says what."""

import dataclasses
import json
import subprocess
import sys

import pytest

from tests.launch import REPO
from torchpre.errors import ConfigError, InputFileError
from torchpre.planner.hardware import HARDWARE, Hardware, get_hardware, load_profile, save_profile


def test_rows_hold_the_datasheet_numbers():
    h100, h200, a100 = (get_hardware(name) for name in ("h100-80gb", "h200-141gb", "a100-80gb"))
    MiB, GiB = 2**20, 2**30  # memory as the driver reports it: nvidia-smi's total, cudaMemGetInfo's on the A100
    assert (h100.peak_flops, h100.memory_bytes, h100.intra_node_bw, h100.inter_node_bw, h100.mem_bw) == (
        989e12, 81_559 * MiB, 450e9, 50e9, 3.35e12)
    assert (h200.peak_flops, h200.memory_bytes, h200.intra_node_bw, h200.inter_node_bw, h200.mem_bw) == (
        989e12, 143_771 * MiB, 450e9, 50e9, 4.8e12)
    assert (a100.peak_flops, a100.memory_bytes, a100.intra_node_bw, a100.inter_node_bw, a100.mem_bw) == (
        312e12, 79.15 * GiB, 300e9, 25e9, 2.0e12)
    # a layout fits when its allocator peak is within the memory less the CUDA context and NCCL's buffers (1 GiB)
    assert h100.allocator_bytes == (81_559 - 1024) * MiB
    for row in (h100, h200, a100):
        assert (row.overlap, row.gpus_per_node) == (1.0, 8)
    # fitted on the corpus's calibration rows (bench/plan_vs_published.py --fit): MosaicML's H100 BF16 table for the
    # H100 (and the H200, the same chip), Megatron-LM 2021 for the A100's matmuls (its attention was not flash); the
    # A100's attention is the FlashAttention-2 paper's range for FlashAttention on A100 (25-40% of peak), its middle
    assert [(row.matmul_efficiency, row.attention_efficiency) for row in (h100, h200, a100)] == [
        (0.59, 0.18), (0.59, 0.18), (0.61, 0.325)]
    # 8 NICs per node, rail-optimised: 8 x 400 Gb/s (H100, H200), 8 x 200 Gb/s (A100)
    assert [(row.nics_per_node, row.nic_bw_per_device) for row in (h100, h200, a100)] == [(8, 50e9), (8, 50e9),
                                                                                          (8, 25e9)]
    for row in HARDWARE.values():
        assert not row.reduce_scatter_as_all_reduce


def test_the_published_platform_holds_its_sheet_and_the_calibrated_efficiencies():
    """torchtitan's Grand Teton H100 (96 GB HBM2e at 2.4 TB/s, 500 W): the SXM datasheet's peaks, the benchmark's
    memory and links; the efficiencies bench/plan_vs_published.py calibrates (FP8 matmuls take the bf16 one)."""
    row = get_hardware("h100-96gb-hbm2e-500w")
    assert (row.peak_flops, row.fp8_peak_flops, row.memory_bytes, row.mem_bw) == (989e12, 1979e12, 96e9, 2.4e12)
    assert (row.intra_node_bw, row.inter_node_bw, row.gpus_per_node) == (450e9, 50e9, 8)
    assert (row.matmul_efficiency, row.fp8_matmul_efficiency, row.attention_efficiency) == (0.58, 0.0, 0.21)


def test_a_profile_round_trips_and_is_selected_by_its_path(tmp_path):
    custom = dataclasses.replace(HARDWARE["h100-80gb"], name="my-gpu", gpus_per_node=4, overlap=0.5)
    path = tmp_path / "my-gpu.json"
    save_profile(custom, path)
    assert load_profile(path) == custom
    assert get_hardware(str(path)) == custom
    # a profile written before nics_per_node: one NIC per device, inter_node_bw each, as it was read then
    fields = dataclasses.asdict(custom)
    del fields["nics_per_node"]
    path.write_text(json.dumps(fields))
    assert load_profile(path).nic_bw_per_device == custom.inter_node_bw


def test_an_unknown_name_names_the_choices_and_the_closest():
    with pytest.raises(ConfigError) as error:
        get_hardware("h100-80g", key="job.dry_run_gpu")
    message = str(error.value)
    assert "job.dry_run_gpu = 'h100-80g'" in message and "Did you mean 'h100-80gb'?" in message
    assert "h200-141gb" in message and "a100-80gb" in message and "--calibrate" in message


@pytest.mark.parametrize(
    "content, fragment",
    [
        ("{not json", "is not valid JSON"),
        ("[1, 2]", "must hold a JSON object"),
        (json.dumps({"name": "x", "peak_flops": 1e12, "speed": 3}), "unknown fields speed; missing fields"),
        ("PEAK0", "field peak_flops = 0 is out of range"),
        ("OVERLAP2", "field overlap = 2 is out of range"),
        ("NODES", "field gpus_per_node = 2.5 is out of range"),
    ],
)
def test_a_bad_profile_says_which_field(tmp_path, content, fragment):
    fields = dataclasses.asdict(HARDWARE["a100-80gb"])
    bad = {"PEAK0": {**fields, "peak_flops": 0}, "OVERLAP2": {**fields, "overlap": 2},
           "NODES": {**fields, "gpus_per_node": 2.5}}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad[content]) if content in bad else content)
    with pytest.raises(InputFileError, match=fragment) as error:
        get_hardware(str(path), key="plan.gpu_profile")
    assert f"plan.gpu_profile = '{path}'" in str(error.value)


def test_a_missing_profile_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no such profile file"):
        get_hardware(str(tmp_path / "absent.json"))


def test_the_module_imports_without_torch(tmp_path):
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('torch is hidden by this test')\n")
    code = "import torchpre.planner.hardware as h; print(h.get_hardware('a100-80gb').name)"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
        env={"PYTHONPATH": f"{tmp_path}:{REPO}", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "a100-80gb"
    assert Hardware.__doc__ and "bytes/s" in Hardware.__doc__
