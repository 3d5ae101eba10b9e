"""bench/memory.py's quick mode measures real effects: full activation checkpointing keeps fewer activations,
ZeRO-1 halves the optimizer state at dp=2, and recomputation leaves the loss bitwise unchanged."""

import pytest

from bench.memory import DP, Result, loss_mismatches, run

pytestmark = [pytest.mark.slow, pytest.mark.bench]


@pytest.fixture(scope="module")
def results() -> dict[tuple[str, int], Result]:
    """One quick run shared by the tests (three torchrun jobs of the tiny model)."""
    return {(r.ac_mode, r.zero_stage): r for r in run(quick=True, steps=2)}


def test_full_ac_keeps_fewer_activations(results: dict[tuple[str, int], Result]) -> None:
    none, full = results["none", 0], results["full", 0]
    assert 0 < full.activation_bytes < none.activation_bytes
    assert full.tensor_peak_bytes < none.tensor_peak_bytes


def test_zero1_halves_optimizer_state(results: dict[tuple[str, int], Result]) -> None:
    zero0, zero1 = results["none", 0], results["none", 1]
    assert zero1.optimizer_state_bytes == pytest.approx(zero0.optimizer_state_bytes / DP, rel=0.01)
    for result in (zero0, zero1):
        assert result.optimizer_state_bytes == pytest.approx(result.optimizer_state_theory, rel=0.01)


def test_losses_equal_across_ac_modes(results: dict[tuple[str, int], Result]) -> None:
    assert results["full", 0].loss == results["none", 0].loss
    assert not loss_mismatches(list(results.values()))
