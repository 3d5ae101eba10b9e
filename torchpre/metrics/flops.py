"""Peak FLOP/s of one device, for model FLOPs utilisation."""

import time

import torch

# Dense bf16 tensor-core peaks from the vendors' datasheets, matched against the device name.
GPU_PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
    "L4": 121e12,
}


def peak_flops(device: torch.device, configured: float = 0.0) -> float:
    """`configured` when given, else the datasheet peak of a known GPU, else a measured matmul peak."""
    if configured > 0:
        return configured
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, flops in GPU_PEAK_BF16_FLOPS.items():
            if key in name:
                return flops
        return measure_matmul_flops(device, torch.bfloat16)
    return measure_matmul_flops(device, torch.float32)


def measure_matmul_flops(
    device: torch.device, dtype: torch.dtype, size: int = 1024, seconds: float = 0.5, windows: int = 5
) -> float:
    """FLOP/s of a square matmul with the threads this process has: the practical peak on CPU.

    The best of `windows` short windows, not their mean: other load on the machine only ever slows a
    window down, so the fastest one is the closest to what the hardware can do (an upper bound for MFU).
    """
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    torch.mm(a, b)
    _synchronize(device)
    return max(_matmul_rate(a, b, device, seconds / windows) for _ in range(windows))


def _matmul_rate(a: torch.Tensor, b: torch.Tensor, device: torch.device, seconds: float) -> float:
    iterations, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, b)
        iterations += 1
        if device.type == "cuda" and iterations % 10:
            continue
        _synchronize(device)
    _synchronize(device)
    return 2 * a.shape[0] ** 3 * iterations / (time.perf_counter() - start)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
