"""bf16 parameters accumulate their gradients in fp32 under the zero-bubble schedules too.

torch's zero-bubble weight backward adds each microbatch's weight gradient with `weight.grad += dw`, in the
parameter's dtype, and fires no post-accumulate-grad hook: unless torchpre moves each microbatch's gradient
into the fp32 accumulator itself, a bf16 model sums its microbatches in bf16 under these schedules only.
"""

import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.gpt2_model import GPT2, TP_PLAN, GPT2Args
from tests.launch import spawn
from tests.optimizers import entries
from torchpre.distributed.parallel_dims import ParallelDims
from torchpre.optim import build_optimizer
from torchpre.parallel import ParallelPlan, PipelinePlan, parallelize, pipeline_stages

pytestmark = pytest.mark.slow

ARGS = GPT2Args(vocab_size=256)
MICROBATCHES = 4
ZERO_BUBBLE = ("ZBVZeroBubble", "InterleavedZeroBubble", "DualPipeV")
# The reference, 1F1B, runs ordinary backward: each microbatch's bf16 gradient goes into the fp32 accumulator
# through the post-accumulate-grad hook. A zero-bubble schedule computes the same bf16 per-microbatch gradients
# and must add them in fp32 in the same order: measured bitwise equal; the tolerance leaves room for another
# order of the 4 fp32 additions only. Summing in bf16 (the bug) was off by up to 8.5e-4 absolute (proj biases).
RTOL, ATOL = 1e-6, 1e-9


def cross_entropy_per_microbatch(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten()) / MICROBATCHES


def fp32_gradients(schedule: str) -> dict[str, torch.Tensor]:
    """One forward-backward of a bf16 GPT-2 at pp2 under `schedule`; the accumulated fp32 gradient by name."""
    mesh = ParallelDims.from_degrees(dp=1, tp=1, pp=2, world_size=2).build_mesh("cpu")
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("meta"):
        model = GPT2(ARGS)
    torch.set_default_dtype(torch.float32)
    stages = 2 if schedule == "1F1B" else 4
    pipeline = PipelinePlan.build(pipeline_stages(model, stages, blocks="h"), pp=2, schedule=schedule,
                                  n_microbatches=MICROBATCHES)
    plan = ParallelPlan(tensor_parallel=TP_PLAN, pipeline=pipeline, blocks="h",
                        tied_weights=("wte.weight", "lm_head.weight"))
    model = parallelize(model, mesh, plan, device=torch.device("cpu"), init_weights=lambda m: m.init_weights(3),
                        loss_fn=cross_entropy_per_microbatch)
    optimizer = build_optimizer(model)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, ARGS.vocab_size, (MICROBATCHES, 17), generator=generator)
    model.forward_backward([(tokens[:, :-1], tokens[:, 1:])])
    return {e.name: grad.clone() for e, grad in zip(entries(optimizer), optimizer.reduction.local_gradients())}


def run_schedules(out: Path, _mesh) -> None:
    results = {schedule: fp32_gradients(schedule) for schedule in ("1F1B", *ZERO_BUBBLE)}
    torch.save(results, out / f"rank{dist.get_rank()}.pt")


def test_zero_bubble_schedules_accumulate_bf16_gradients_in_fp32(tmp_path):
    spawn(functools.partial(run_schedules, tmp_path), 2, tmp_path / "store", timeout_s=300)
    by_schedule: dict[str, dict[str, torch.Tensor]] = {}
    for rank in range(2):
        for schedule, grads in torch.load(tmp_path / f"rank{rank}.pt").items():
            by_schedule.setdefault(schedule, {}).update(grads)
    reference = by_schedule["1F1B"]
    assert all(grad.dtype == torch.float32 for grad in reference.values())
    for schedule in ZERO_BUBBLE:
        assert by_schedule[schedule].keys() == reference.keys(), schedule
        for name, grad in reference.items():
            torch.testing.assert_close(by_schedule[schedule][name], grad, rtol=RTOL, atol=ATOL,
                                       msg=f"{schedule}: {name}")
