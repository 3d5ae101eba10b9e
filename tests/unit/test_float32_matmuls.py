"""training.tf32: which float32 matmul precision a job sets, and only for CUDA jobs."""

import pytest
import torch

from torchpre.distributed.process_groups import configure_float32_matmuls


@pytest.mark.parametrize(
    "device, tf32, precision", [("cuda", True, "high"), ("cuda", False, "highest"), ("cpu", True, None)]
)
def test_fp32_matmuls_use_tf32_on_cuda_only(device, tf32, precision, monkeypatch):
    """TF32 tensor cores for a CUDA job's fp32 matmuls, or full fp32; a CPU job's precision is never touched
    (the setting is process-wide)."""
    calls = []
    monkeypatch.setattr(torch, "set_float32_matmul_precision", calls.append)
    configure_float32_matmuls(torch.device(device), tf32)
    assert calls == ([precision] if precision else [])
