"""NaN forensics: where a non-finite step started, found by replaying it with a hook on every module.

The trainer's guard (`torchpre.health.verdict.step_verdict`) knows only that a step's loss or gradient norm is not
finite. `locate_nonfinite` runs the same step's forward and backward again (the caller's `replay`, through the
same schedule, so every layout works) while `NonFiniteProbe` watches each module of this rank's model parts:
in forward, its output; in backward, the gradient with respect to its output (a tensor hook). Each rank keeps,
per phase, pipeline stage and microbatch, the first module in execution order whose values were not finite;
one `all_gather_object` gives every rank all of them, and every rank picks the same origin:

- a forward finding beats any backward one (a non-finite activation makes every gradient after it so);
- forward: the lowest microbatch, then the earliest pipeline stage (activations flow to later stages);
- backward: the lowest microbatch, then the latest stage (gradients flow to earlier stages);
- then the lowest rank (data- and tensor-parallel peers run at the same time).

In backward the module named is the one whose *output* received the first non-finite gradient: the value was
produced by the backward of what consumes that output. Tensor hooks are used rather than full backward hooks
(which would name that consumer) because they leave the autograd graph as it is: full backward hooks wrap every
module's inputs and outputs in extra autograd nodes that in-place updates and split (zero-bubble) backwards trip
over, and the replay must run wherever the step ran. Modules inside a `torch.compile`d block are compiled without
the hooks, so there the answer stops at the block.
"""

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from torchpre.distributed.names import canonical_fqn

FORWARD, BACKWARD = "forward", "backward"


@dataclass(frozen=True)
class Finding:
    """The first module with a non-finite output (forward) or output gradient (backward), and where it ran:
    `rank` (global), `dp_rank`, the pipeline `stage` and the `microbatch` (index among this rank's microbatches
    of the step: the pipeline schedule's under pipeline parallelism, else the gradient-accumulation ones)."""

    module: str
    phase: str
    rank: int
    dp_rank: int
    stage: int
    microbatch: int

    def order(self) -> tuple[int, int, int, int]:
        """Sort key: the earlier a finding sorts, the closer it is to the origin (see the module docstring)."""
        stage = self.stage if self.phase == FORWARD else -self.stage
        return (self.phase != FORWARD, self.microbatch, stage, self.rank)


class NonFiniteProbe:
    """While entered, records for every module of `parts` whether its forward output and the gradient of that
    output are finite, with the microbatch (counted by calls of each part) and the part's pipeline stage.

    The checks stay on the device until `first_findings()`, which syncs once; module outputs that are DTensors
    are checked on this rank's shard (no collective inside a hook).
    """

    def __init__(self, parts: Sequence[nn.Module], stage_ids: Sequence[int]):
        self.parts, self.stage_ids = list(parts), list(stage_ids)
        self._calls = [0] * len(self.parts)
        # (phase, module name, part index, microbatch, a boolean tensor: all finite)
        self._checks: list[tuple[str, str, int, int, torch.Tensor]] = []
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> "NonFiniteProbe":
        for index, part in enumerate(self.parts):
            self._handles.append(part.register_forward_pre_hook(functools.partial(self._count, index)))
            for name, module in part.named_modules():
                hook = functools.partial(self._on_output, canonical_fqn(name) or type(part).__name__, index)
                self._handles.append(module.register_forward_hook(hook))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _count(self, index: int, module: nn.Module, args) -> None:
        self._calls[index] += 1

    def _on_output(self, name: str, index: int, module: nn.Module, args, output) -> None:
        microbatch = self._calls[index] - 1
        tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if not tensors:
            return
        self._checks.append((FORWARD, name, index, microbatch, _all_finite(tensors)))
        for tensor in tensors:
            if tensor.requires_grad:
                tensor.register_hook(functools.partial(self._on_grad, name, index, microbatch))

    def _on_grad(self, name: str, index: int, microbatch: int, grad: torch.Tensor) -> None:
        self._checks.append((BACKWARD, name, index, microbatch, _all_finite([grad])))

    def first_findings(self, rank: int, dp_rank: int) -> list[Finding]:
        """Per (phase, part, microbatch), the first module in execution order whose check failed."""
        if not self._checks:
            return []
        finite = torch.stack([check[-1] for check in self._checks]).tolist()
        first: dict[tuple[str, int, int], Finding] = {}
        for (phase, name, index, microbatch, _), ok in zip(self._checks, finite):
            if not ok and (phase, index, microbatch) not in first:
                first[phase, index, microbatch] = Finding(
                    name, phase, rank, dp_rank, self.stage_ids[index], microbatch
                )
        return list(first.values())


def _all_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return torch.stack([torch.isfinite(t.detach()).all() for t in local]).all()


def locate_nonfinite(
    parts: Sequence[nn.Module], stage_ids: Sequence[int], dp_rank: int, replay: Callable[[], None]
) -> Finding | None:
    """Runs `replay()` under a `NonFiniteProbe` and returns the job-wide origin of the non-finite values, the
    same on every rank (None if no module saw one: it arose outside the modules, e.g. in the loss). A
    collective: every rank must call it for the same step."""
    with NonFiniteProbe(parts, stage_ids) as probe:
        replay()
    findings: list[list[Finding]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(findings, probe.first_findings(dist.get_rank(), dp_rank))
    return min((f for rank_findings in findings for f in rank_findings), key=Finding.order, default=None)


def microbatch_samples(
    first_sample: int, local_batch_size: int, dp_size: int, dp_rank: int, rows_per_microbatch: int, microbatch: int
) -> list[tuple[int, int]]:
    """The global sample indices ([start, end) ranges) of one microbatch of a step whose global batch starts at
    `first_sample`.

    A DP rank's rows for a step are its gradient-accumulation microbatches one after the other, and in round a
    it takes samples [a x local x dp + rank x local, + local) of the step (`torchpre.data.sampler`); a pipeline
    schedule cuts those rows into microbatches of `rows_per_microbatch`.
    """
    ranges: list[tuple[int, int]] = []
    for row in range(microbatch * rows_per_microbatch, (microbatch + 1) * rows_per_microbatch):
        round_, offset = divmod(row, local_batch_size)
        sample = first_sample + round_ * local_batch_size * dp_size + dp_rank * local_batch_size + offset
        if ranges and ranges[-1][1] == sample:
            ranges[-1] = (ranges[-1][0], sample + 1)
        else:
            ranges.append((sample, sample + 1))
    return ranges


def describe(finding: Finding | None, samples: list[tuple[int, int]]) -> str:
    """One sentence for the log and the error message."""
    if finding is None:
        return (
            "Replaying the step with a check on every module found no module whose output or output gradient was "
            "not finite: the non-finite value arose outside the modules (e.g. in the loss or the optimizer), or the "
            "replay did not reproduce it (non-deterministic kernels)."
        )
    what = (
        f"the first non-finite value was the output of {finding.module} (forward)"
        if finding.phase == FORWARD
        else f"the forward stayed finite and the first non-finite value was the gradient of the output of "
        f"{finding.module} (backward; computed by the backward of what consumes that output)"
    )
    where = ", ".join(f"[{start}, {end})" for start, end in samples)
    return (
        f"Replaying the step, {what} on rank {finding.rank}, pipeline stage {finding.stage}, microbatch "
        f"{finding.microbatch} (global samples {where})."
    )


def as_metrics(finding: Finding | None) -> dict[str, str | int]:
    """The `nonfinite/*` keys of a metrics record (first_module "" when no module saw a non-finite value)."""
    if finding is None:
        return {"nonfinite/first_module": ""}
    return {
        "nonfinite/first_module": finding.module,
        "nonfinite/phase": finding.phase,
        "nonfinite/rank": finding.rank,
        "nonfinite/stage": finding.stage,
        "nonfinite/microbatch": finding.microbatch,
    }


@dataclass(frozen=True)
class Forensics:
    """What a replay watches and how its finding maps back to data: this rank's model `parts` and their pipeline
    `stage_ids`, its `dp_rank` of `dp_size`, the sequences per DP rank per gradient-accumulation microbatch
    (`local_batch_size`) and per microbatch of the replay (`rows_per_microbatch`: the pipeline's, else the local
    batch)."""

    parts: Sequence[nn.Module]
    stage_ids: Sequence[int]
    dp_rank: int
    dp_size: int
    local_batch_size: int
    rows_per_microbatch: int

    def locate(self, replay: Callable[[], None], first_sample: int) -> tuple[str, dict[str, str | int]]:
        """Runs `replay()` (a collective, see `locate_nonfinite`) of the step that started at global sample
        `first_sample`; returns the sentence naming the origin and its `nonfinite/*` metrics."""
        finding = locate_nonfinite(self.parts, self.stage_ids, self.dp_rank, replay)
        if finding is None:
            return describe(None, []), as_metrics(None)
        samples = microbatch_samples(
            first_sample, self.local_batch_size, self.dp_size, finding.dp_rank, self.rows_per_microbatch,
            finding.microbatch,
        )
        return describe(finding, samples), as_metrics(finding)
