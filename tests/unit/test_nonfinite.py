"""NaN forensics on its own: the probe names the first module whose output (forward) or output gradient
(backward) is not finite, with its microbatch; the job-wide choice of an origin; and the global sample
indices of a microbatch, checked against the data sampler itself."""

import pytest
import torch
from torch import nn

from torchpre.data.sampler import GlobalBatchSampler
from torchpre.health.forensics import BACKWARD, FORWARD, Finding, NonFiniteProbe, microbatch_samples


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 1))


def _set_inf(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.clone()
    tensor[0, 0] = float("inf")
    return tensor


def _run(model: nn.Module, microbatches: int, probe: NonFiniteProbe) -> list[Finding]:
    with probe:
        for _ in range(microbatches):
            model(torch.randn(2, 4)).sum().backward()
    return probe.first_findings(rank=3, dp_rank=1)


def test_the_first_module_whose_output_is_inf_is_named_in_forward_and_in_backward():
    model = _model()
    calls = []

    def inject_on_second_call(module, args, output):
        calls.append(1)
        return _set_inf(output) if len(calls) == 2 else None

    model[1][0].register_forward_hook(inject_on_second_call)  # "1.0", in the second microbatch only
    findings = _run(model, 2, NonFiniteProbe([model], stage_ids=[5]))
    # Its parent "1" and "2" after it are inf too, but later in execution order.
    assert Finding("1.0", FORWARD, rank=3, dp_rank=1, stage=5, microbatch=1) in findings
    assert {f.module for f in findings if f.phase == FORWARD} == {"1.0"}
    assert all(f.microbatch == 1 for f in findings)


def test_an_inf_gradient_names_the_module_whose_output_received_it():
    model = _model()
    model[0].register_forward_hook(lambda module, args, output: output.register_hook(_set_inf) and None)
    findings = _run(model, 1, NonFiniteProbe([model], stage_ids=[0]))
    # Backward runs "Sequential" (the root), "2", "1", "1.1", "1.0", "0": the gradients reaching "0"'s output are
    # the first non-finite ones; the parameter gradients of "0" then are too, but no activation is.
    assert findings == [Finding("0", BACKWARD, rank=3, dp_rank=1, stage=0, microbatch=0)]


def test_a_finite_replay_finds_nothing_and_the_hooks_are_removed():
    model = _model()
    probe = NonFiniteProbe([model], stage_ids=[0])
    assert _run(model, 2, probe) == []
    model(torch.randn(2, 4)).sum().backward()
    assert len(probe._checks) == 2 * 2 * 6  # 2 microbatches x forward and backward x 6 modules; none after exit


def _finding(phase: str, stage: int, microbatch: int = 0, rank: int = 0) -> Finding:
    return Finding(f"m{stage}", phase, rank, 0, stage, microbatch)


def test_the_origin_is_forward_first_then_by_microbatch_then_in_the_direction_values_flow():
    earliest = min(
        [_finding(BACKWARD, 3), _finding(FORWARD, 2, rank=1), _finding(FORWARD, 1, rank=2)], key=Finding.order
    )
    assert earliest == _finding(FORWARD, 1, rank=2)  # activations flow from stage 1 to stage 2
    assert min([_finding(BACKWARD, 1), _finding(BACKWARD, 2)], key=Finding.order).stage == 2  # gradients 2 -> 1
    assert min([_finding(FORWARD, 0, microbatch=1), _finding(FORWARD, 1)], key=Finding.order).microbatch == 0
    assert min([_finding(FORWARD, 1, rank=1), _finding(FORWARD, 1, rank=0)], key=Finding.order).rank == 0


@pytest.mark.parametrize(
    "local_batch_size, dp, accumulation, rows_per_microbatch",
    [(4, 1, 1, 4), (4, 2, 3, 4), (4, 2, 2, 2), (4, 2, 2, 8), (2, 3, 3, 3)],
)
def test_microbatch_samples_are_those_the_sampler_gave_the_rank(
    local_batch_size: int, dp: int, accumulation: int, rows_per_microbatch: int
):
    """Rows of a rank's step are its accumulation microbatches, concatenated and cut into (pipeline) microbatches."""
    first_sample = 2 * local_batch_size * dp * accumulation  # the third step
    for dp_rank in range(dp):
        sampler = GlobalBatchSampler(lambda position: position, local_batch_size, dp_rank, dp)
        sampler.consumed_samples = first_sample
        rows = [index for _ in range(accumulation) for index in next(sampler)]
        for microbatch in range(len(rows) // rows_per_microbatch):
            expected = rows[microbatch * rows_per_microbatch : (microbatch + 1) * rows_per_microbatch]
            ranges = microbatch_samples(
                first_sample, local_batch_size, dp, dp_rank, rows_per_microbatch, microbatch
            )
            assert [i for start, end in ranges for i in range(start, end)] == expected
            assert len(ranges) == len({i // local_batch_size for i in expected})  # one range per contiguous run
