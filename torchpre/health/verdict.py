"""Each step's job-wide verdict: its global loss, whether the loss and the gradient norm are finite, and the
agreement to stop (preemption) that travels with it, from one all-reduce that stays on the device."""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from torchpre.errors import TorchpreError


class NonFiniteError(TorchpreError):
    """A step produced a non-finite loss or gradient norm under `training.on_nonfinite = "stop"`."""


@dataclass(frozen=True)
class StepHealth:
    """One step's global loss, whether it and the global gradient norm are finite, and whether any rank
    asked the job to stop after this step."""

    loss: float
    loss_finite: bool
    grad_norm_finite: bool
    stop_requested: bool = False

    @property
    def finite(self) -> bool:
        return self.loss_finite and self.grad_norm_finite

    def describe_nonfinite(self) -> str:
        """What made the step unusable: "the loss", "the gradient norm" or both."""
        checks = (("the loss", self.loss_finite), ("the gradient norm", self.grad_norm_finite))
        return " and ".join(name for name, ok in checks if not ok)


class StepVerdict:
    """Every rank's verdict on a step, from one all-reduce of four numbers: [loss, loss not finite, gradient norm
    not finite, stop requested], summed over ranks, so identical on all of them.

    It stays on the device: `skip` is the flag a conditional optimizer step takes (torch's fused optimizers skip
    the update where it is 1), and a copy to pinned host memory starts at once, behind the work queued so far.
    `read()` waits for that copy only: read during the next step, it never waits for the work queued after it.
    """

    def __init__(self, values: torch.Tensor, tp_degree: int) -> None:
        self.values, self.tp_degree = values, tp_degree
        self.skip = (values[1] + values[2] > 0).float()
        if values.is_cuda:
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._copied: torch.cuda.Event | None = torch.cuda.Event()
            self._copied.record()
        else:
            self._host, self._copied = values, None

    def read(self) -> StepHealth:
        """The verdict on the host (the step's one host sync)."""
        if self._copied is not None:
            self._copied.synchronize()
        loss, bad_loss, bad_norm, stops = self._host.tolist()
        return StepHealth(
            loss=loss / self.tp_degree, loss_finite=bad_loss == 0, grad_norm_finite=bad_norm == 0,
            stop_requested=stops > 0,
        )


def step_verdict(
    loss_share: torch.Tensor, grad_norm: torch.Tensor, tp_degree: int, stop_requested: bool = False
) -> StepVerdict:
    """The step's verdict (`StepVerdict`), all-reduced without a host sync.

    `loss_share` is this rank's part of the global mean loss (0 off the last pipeline stage); each
    tensor-parallel rank holds the same share, hence the division by `tp_degree`. The norm is already
    global, but its flag is summed too so that the decision travels in the same collective. So does
    `stop_requested` (this rank got SIGTERM): a signal reaches ranks at slightly different steps, and
    summing the flags makes every rank stop after the same one.
    """
    loss_share = loss_share.detach().float()
    values = torch.stack(
        [
            loss_share,
            (~torch.isfinite(loss_share)).float(),
            (~torch.isfinite(grad_norm)).float(),
            torch.full_like(loss_share, float(stop_requested)),
        ]
    )
    if dist.get_world_size() > 1:  # a job of one process has no peer to agree with
        dist.all_reduce(values)
    return StepVerdict(values, tp_degree)
