"""Peak FLOP/s of one device, for model FLOPs utilisation."""

import time

import torch

# Dense bf16 tensor-core peaks from the vendors' datasheets, matched against the device name (B200: the HGX B200
# sheet's 36 PF with sparsity for 8 GPUs, halved).
GPU_PEAK_BF16_FLOPS = {
    "B200": 2250e12,
    "H200": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
    "L4": 121e12,
}
# Dense FP8 (e4m3) tensor-core peaks: NVIDIA's datasheets print them with 2:4 sparsity, these are half of those
# (H100/H200 SXM 3,958 -> 1,979; H100 NVL 3,341; H100 PCIe 3,026; L40S 1,466; L4 485; B200 9,000 -> 4,500, the
# HGX B200 sheet's 72 PF for 8 GPUs, which MXFP8 shares). A100 and A10G have no FP8 tensor cores: not listed.
GPU_PEAK_FP8_FLOPS = {
    "B200": 4500e12,
    "H200": 1979e12,
    "H100 NVL": 1671e12,
    "H100 PCIe": 1513e12,
    "H100": 1979e12,
    "L40S": 733e12,
    "L4": 242e12,
}


def peak_flops(device: torch.device, configured: float = 0.0, linear: str = "none") -> tuple[float, str]:
    """(FLOP/s, which peak): `configured` when given, else a known GPU's datasheet peak (the FP8 one when
    `linear`, quantize.linear, puts the linears' matmuls in float8 or mxfp8 and the GPU has FP8 tensor cores: most
    of the FLOPs then run there), else a measured matmul peak (CPUs emulate FP8 in high precision)."""
    if configured > 0:
        return configured, "configured"
    if device.type != "cuda":
        return measure_matmul_flops(device, torch.float32), "measured fp32"
    name = torch.cuda.get_device_name(device)
    tables = [("fp8", GPU_PEAK_FP8_FLOPS)] if linear != "none" else []
    for label, table in [*tables, ("bf16", GPU_PEAK_BF16_FLOPS)]:
        for key, flops in table.items():
            if key in name:
                return flops, label
    return measure_matmul_flops(device, torch.bfloat16), "measured bf16"


def measure_matmul_flops(
    device: torch.device, dtype: torch.dtype, size: int = 1024, seconds: float = 0.5, windows: int = 5
) -> float:
    """FLOP/s of a square matmul with the threads this process has: the practical peak on CPU.

    The best of `windows` short windows, not their mean: other load on the machine only ever slows a
    window down, so the fastest one is the closest to what the hardware can do (an upper bound for MFU).
    """
    # A generator of its own: the measurement runs at a process's first record, which must not move the training
    # RNG (a resumed run's state would differ from the uninterrupted run's).
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
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
