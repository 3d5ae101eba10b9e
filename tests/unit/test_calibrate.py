"""Calibration: the least-squares fit recovers known numbers, and a real run writes a plausible profile."""

import pytest

from torchpre.planner.calibrate import calibrate, fit_latency_bandwidth
from torchpre.planner.hardware import load_profile


def test_the_fit_recovers_latency_and_bandwidth_exactly():
    latency, bw = 50e-6, 2e9
    samples = [(steps, nbytes, steps * latency + nbytes / bw) for steps in (1, 2) for nbytes in (6e4, 1e6, 1.6e7)]
    fitted = fit_latency_bandwidth(samples)
    assert fitted == pytest.approx((latency, bw), rel=1e-9)


def test_a_negative_latency_fit_is_held_at_zero():
    # times grow faster than linearly in bytes at the small end: the free fit's intercept would be negative
    samples = [(1, 1e3, 1e-7), (1, 1e6, 1e-3), (1, 2e6, 2.2e-3)]
    latency, bw = fit_latency_bandwidth(samples)
    assert latency == 0.0
    # relative least squares through the origin: bw = sum((b/t)^2) / sum(b/t) over the samples
    ratios = [b / t for _, b, t in samples]
    assert bw == pytest.approx(sum(r * r for r in ratios) / sum(ratios), rel=1e-12)


@pytest.mark.slow
def test_calibration_writes_a_plausible_profile(tmp_path):
    """Ranges: a CPU core's fp32 matmul is 1 GFLOP/s to 10 TFLOP/s; loopback gloo moves 0.1 to 100 GB/s with 1 us to
    10 ms per step; DRAM streams 1 to 1000 GB/s; an eager op costs 0.1 us to 1 ms."""
    path = tmp_path / "cpu.json"
    hardware = calibrate(path)
    assert load_profile(path) == hardware
    assert 1e9 <= hardware.peak_flops <= 1e13
    assert 0.05 <= hardware.matmul_efficiency <= 1.0
    assert 1e8 <= hardware.inter_node_bw == hardware.intra_node_bw <= 1e11
    assert 1e-6 <= hardware.latency_s <= 1e-2
    assert 1e9 <= hardware.mem_bw <= 1e12
    assert 1e-7 <= hardware.op_overhead_s <= 1e-3
    assert hardware.memory_bytes >= 1e9 and hardware.reserved_bytes == 0
    assert (hardware.gpus_per_node, hardware.overlap) == (2, 0.0)
