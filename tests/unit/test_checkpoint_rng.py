"""A checkpoint restores every generator a rank draws from: the CPU one and, under CUDA, its device's.

CUDA is faked here (its get/set functions stand on a tensor of our own), so the test runs, and can fail,
on a machine without a GPU.
"""

import pytest
import torch

from tests.unit.test_checkpoint_integrity import _components, _manager
from torchpre.checkpoint.state import RNGState


class FakeCudaGenerator:
    """Stands for the current CUDA device's generator: a byte state that `torch.cuda.*_rng_state` reads and sets."""

    def __init__(self) -> None:
        self.state = torch.arange(16, dtype=torch.uint8)

    def get_rng_state(self, device: str | int = "cuda") -> torch.Tensor:
        return self.state.clone()

    def set_rng_state(self, state: torch.Tensor, device: str | int = "cuda") -> None:
        self.state = state.clone()


@pytest.fixture
def fake_cuda(monkeypatch) -> FakeCudaGenerator:
    generator = FakeCudaGenerator()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", generator.get_rng_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state", generator.set_rng_state)
    return generator


def _with_rng(step: int) -> dict[str, object]:
    return _components(step=step) | {"rng": RNGState()}


def test_cpu_and_cuda_generator_states_come_back(world, fake_cuda, tmp_path):
    checkpoints = _manager(tmp_path, components=_with_rng(step=2))
    torch.manual_seed(1)
    saved_cuda = fake_cuda.get_rng_state()
    checkpoints.save(2)
    expected_cpu_draw = torch.rand(4)

    torch.manual_seed(2)  # the run goes on drawing from both generators
    fake_cuda.state = torch.full((16,), 7, dtype=torch.uint8)
    _manager(tmp_path, components=_with_rng(step=2)).load(tmp_path / "step-2")

    assert torch.equal(fake_cuda.state, saved_cuda)
    assert torch.equal(torch.rand(4), expected_cpu_draw)
