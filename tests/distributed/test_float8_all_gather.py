"""FP8 all-gather under FSDP2 on gloo, for a module whose parameters are all FP8 weights: FSDP then gathers a
float8 buffer, which gloo refuses ("Invalid scalar type") unless `ByteAllGather` sends its bytes as uint8. (A block
that also holds norm weights gathers a mixed uint8 buffer already; the trained runs are in the parity table.)"""

import dataclasses

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from tests.launch import spawn
from torchpre.parallel.data_parallel import ByteAllGather

pytest.importorskip("torchao")


def _model(fp8_all_gather: bool) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128, bias=False), nn.Linear(128, 64, bias=False))
    config = Float8LinearConfig.from_recipe_name("tensorwise")
    config = dataclasses.replace(config, emulate=True, enable_fsdp_float8_all_gather=fp8_all_gather)
    return convert_to_float8_training(model, config=config)


def _step(model: nn.Module, mesh: DeviceMesh, all_gather: ByteAllGather | None) -> list[torch.Tensor]:
    """One forward and backward on this rank's half of the batch; the gradients gathered whole."""
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy())
    if all_gather is not None:
        model.set_custom_all_gather(all_gather)
    inputs = torch.randn(8, 16, 64, generator=torch.Generator().manual_seed(1)).chunk(2)[mesh.get_local_rank()]
    model(inputs).pow(2).mean().backward()
    return [p.grad.full_tensor() for p in model.parameters()]


def _check(mesh: DeviceMesh) -> None:
    with pytest.raises(RuntimeError, match="Invalid scalar type"):
        _step(_model(fp8_all_gather=True), mesh, None)
    high_precision = _step(_model(fp8_all_gather=False), mesh, None)
    fp8 = _step(_model(fp8_all_gather=True), mesh, ByteAllGather())
    # The weight is cast to FP8 with the amax of the whole weight either way: before the gather (all-reduced over the
    # shards) or after it. The same values, so the same gradients, bitwise.
    for a, b in zip(fp8, high_precision):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fp8_all_gather_on_gloo_equals_the_high_precision_gather(tmp_path):
    spawn(_check, world_size=2, store_path=tmp_path / "store")
