"""The bucketed data-parallel gradient reduction of ZeRO stages 0-2 on two gloo ranks, through the public API
(`parallelize`, `build_optimizer`, `forward_backward`), in one spawn: how many collectives a step issues, that
overlapping them with backward (and stage 2's reduce-scatter per microbatch) changes no gradient, that a late
gradient is an error, that the collectives are in flight when backward returns, and the gradient memory kept."""

import functools
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import torchpre.distributed.collectives as collectives
import torchpre.parallel.grad_buckets as grad_buckets
from tests.launch import spawn
from tests.optimizers import entries
from torchpre.distributed.collectives import rank_chunk
from torchpre.distributed.parallel_dims import ParallelDims
from torchpre.optim import build_optimizer
from torchpre.parallel import ParallelModel, ParallelPlan, parallelize
from torchpre.parallel.data_parallel import DataParallel

pytestmark = pytest.mark.slow

MICROBATCHES = 3
BUCKET_BYTES = 700  # 40 parameters of 4 x 4 fp32 (64 B): 10 per bucket, 4 buckets; 80 of 2 x 4 (32 B): 21, 4 too
# fp32 on CPU: overlap, reduce-scatter and per-microbatch sums change only the order of the additions (measured
# differences up to 3e-8 on gradients up to 0.37).
ATOL = 1e-6
# bf16 reduction rounds each reduced value once (8-bit mantissa: relative 2**-8 = 3.9e-3).
BF16_RTOL = 8e-3


class Layer(nn.Module):
    def __init__(self, rows: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.05 * torch.tanh(x @ self.weight.T).sum(-1, keepdim=True) + x


class Stack(nn.Module):
    """`count` one-parameter layers; the last microbatch (2 rows instead of 3) skips layer 1."""

    def __init__(self, count: int, rows: int):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): Layer(rows) for i in range(count)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name, layer in self.layers.items():
            if not (name == "1" and x.shape[0] == 2):
                x = layer(x)
        return x

    def init_weights(self) -> None:
        for i, layer in enumerate(self.layers.values()):
            nn.init.normal_(layer.weight, std=0.5, generator=torch.Generator().manual_seed(i))


def _loss(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return (output - labels).square().sum() / 24  # the global mean over 2 ranks x 3 microbatches


def _microbatches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(10 + dist.get_rank())
    return [(torch.randn(n, 4, generator=generator), torch.randn(n, 4, generator=generator)) for n in (3, 3, 2)]


def _setup(
    mesh: DeviceMesh, count: int = 40, rows: int = 4, zero2_accumulate_locally: bool = False, **options
) -> tuple[ParallelModel, object]:
    with torch.device("meta"):
        model = Stack(count, rows)
    model = parallelize(model, mesh, ParallelPlan(blocks="layers"), device=torch.device("cpu"),
                        init_weights=lambda m: m.init_weights(), loss_fn=_loss)
    strategy = DataParallel(bucket_bytes=BUCKET_BYTES, accumulate_locally=zero2_accumulate_locally, **options)
    return model, build_optimizer(model, max_norm=0.0, data_parallel=strategy)


class CountingCollectives:
    """Counts the DP collectives through the shims every gradient reduction and parameter all-gather go through."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.counts: Counter[str] = Counter()
        for module, name in [(grad_buckets, "all_reduce_flat"), (grad_buckets, "reduce_scatter_flat"),
                             (collectives, "all_gather_flat")]:
            monkeypatch.setattr(module, name, self._counting(name, getattr(module, name)))

    def _counting(self, name, collective):
        def counted(*args, **kwargs):
            self.counts[name] += 1
            return collective(*args, **kwargs)

        return counted


def _step_counts(mesh: DeviceMesh, count: int, rows: int, zero_stage: int) -> tuple[int, Counter[str]]:
    """(buckets, collectives issued by one step) for a model of `count` parameters of `rows` x 4."""
    model, optimizer = _setup(mesh, count, rows, zero_stage=zero_stage)
    with pytest.MonkeyPatch.context() as monkeypatch:
        counting = CountingCollectives(monkeypatch)
        model.forward_backward(_microbatches())
        optimizer.step()
    return len(optimizer.reduction.buckets.buckets), counting.counts


def _check_collective_counts(mesh: DeviceMesh) -> None:
    for zero_stage in (0, 1, 2):
        buckets, counts = _step_counts(mesh, 40, 4, zero_stage)
        doubled_buckets, doubled = _step_counts(mesh, 80, 2, zero_stage)
        assert buckets == doubled_buckets == 4, (buckets, doubled_buckets)
        reductions = {0: buckets, 1: buckets, 2: buckets * MICROBATCHES}[zero_stage]
        reduce = "all_reduce_flat" if zero_stage == 0 else "reduce_scatter_flat"
        expected = Counter({reduce: reductions, **({"all_gather_flat": buckets} if zero_stage else {})})
        assert counts == expected == doubled, (zero_stage, counts, doubled)


def _reduced_gradients(mesh: DeviceMesh, **options) -> dict[str, torch.Tensor]:
    """Each parameter's DP-reduced gradient after one step's 3 microbatches (this rank's chunk under ZeRO 1-2)."""
    model, optimizer = _setup(mesh, **options)
    model.forward_backward(_microbatches())
    optimizer.reduce_gradients()
    grads = {e.name: e.master.grad.clone() for e in entries(optimizer)}
    optimizer.discard()
    return grads


def _check_gradients(mesh: DeviceMesh) -> None:
    reference = _reduced_gradients(mesh, zero_stage=0, overlap_grad_reduce=False)
    assert reference["layers.1.weight"].abs().sum() > 0  # used on 2 of the 3 microbatches
    rank = dist.get_rank()
    cases = [
        ({"zero_stage": 0}, 0, ATOL),
        ({"zero_stage": 1}, 1, ATOL),
        ({"zero_stage": 1, "overlap_grad_reduce": False}, 1, ATOL),
        ({"zero_stage": 2}, 1, ATOL),
        ({"zero_stage": 2, "zero2_accumulate_locally": True}, 1, ATOL),
        ({"zero_stage": 2, "overlap_grad_reduce": False}, 1, ATOL),
        ({"zero_stage": 2, "reduce_dtype": torch.bfloat16}, 1, None),
        ({"zero_stage": 1, "reduce_dtype": torch.bfloat16}, 1, None),
        ({"zero_stage": 0, "reduce_dtype": torch.bfloat16}, 0, None),
    ]
    for options, sharded, atol in cases:
        grads = _reduced_gradients(mesh, **options)
        for name, full in reference.items():
            expected = rank_chunk(full, 0, 2, rank) if sharded else full
            if atol is None:
                torch.testing.assert_close(grads[name], expected, rtol=BF16_RTOL, atol=1e-3, msg=f"{options} {name}")
            else:
                torch.testing.assert_close(grads[name], expected, rtol=0, atol=atol, msg=f"{options} {name}")


def _check_late_gradient_raises(mesh: DeviceMesh) -> None:
    model, optimizer = _setup(mesh, zero_stage=1)
    model.forward_backward(_microbatches())  # the last backward launched every bucket
    inputs, labels = _microbatches()[0]
    with pytest.raises(RuntimeError, match=r"'layers\.\d+\.weight' arrived after its bucket"):
        _loss(model.parts[0](inputs), labels).backward()
    for layer in model.parts[0].layers.values():
        layer.weight.grad = None
    optimizer.reduction.buckets.finish()


def _check_overlap(mesh: DeviceMesh) -> None:
    for zero_stage in (0, 1, 2):
        model, optimizer = _setup(mesh, zero_stage=zero_stage)
        model.forward_backward(_microbatches())
        in_flight = len(optimizer.reduction.buckets.in_flight())
        # All but the bucket holding layer 1 (no gradient on the last microbatch: launched by reduce_gradients);
        # stage 2 keeps at most 2 reduce-scatters in flight (each holds a full transient bucket).
        expected = len(optimizer.reduction.buckets.buckets) - 1 if zero_stage < 2 else grad_buckets.MAX_IN_FLIGHT
        assert in_flight == expected, (zero_stage, in_flight)
        optimizer.step()
        model, optimizer = _setup(mesh, zero_stage=zero_stage, overlap_grad_reduce=False)
        model.forward_backward(_microbatches())
        assert optimizer.reduction.buckets.in_flight() == [], zero_stage
        optimizer.step()


def _check_stage2_state_is_stage1s(mesh: DeviceMesh) -> None:
    """Same placements, shapes and values: a stage-1 checkpoint is a stage-2 one."""
    states = []
    for zero_stage in (1, 2):
        model, optimizer = _setup(mesh, zero_stage=zero_stage)
        model.forward_backward(_microbatches())
        optimizer.step()
        states.append(optimizer.state_dict())
    for name, state in states[0].items():
        for key, value in state.items():
            other = states[1][name][key]
            if isinstance(value, torch.Tensor) and value.ndim:
                assert (value.placements, value.shape) == (other.placements, other.shape), (name, key)
                torch.testing.assert_close(other.to_local(), value.to_local(), rtol=0, atol=ATOL)


def _check_gradient_memory(mesh: DeviceMesh) -> None:
    """Persistent gradient bytes per parameter: 4 (one fp32 buffer) under stages 0-1, 4 / dp under stage 2 (the
    40 x 16 elements split evenly: no padding)."""
    numel = 40 * 16
    for zero_stage, expected in [(0, 4 * numel), (1, 4 * numel), (2, 4 * numel // 2)]:
        model, optimizer = _setup(mesh, zero_stage=zero_stage)
        model.forward_backward(_microbatches())
        optimizer.step()
        measured = optimizer.reduction.buckets.grad_bytes()
        assert measured == expected, (zero_stage, measured)
    _, optimizer = _setup(mesh, zero_stage=2, zero2_accumulate_locally=True)
    assert optimizer.reduction.buckets.grad_bytes() == 4 * numel // 2


def _check_all(_mesh: DeviceMesh) -> None:
    mesh = ParallelDims.from_degrees(dp=2, tp=1, pp=1, world_size=2).build_mesh("cpu")
    _check_collective_counts(mesh)
    _check_gradients(mesh)
    _check_late_gradient_raises(mesh)
    _check_overlap(mesh)
    _check_stage2_state_is_stage1s(mesh)
    _check_gradient_memory(mesh)


def test_bucketed_gradient_reduction_on_two_ranks(tmp_path):
    spawn(functools.partial(_check_all), world_size=2, store_path=tmp_path / "store", timeout_s=180)
