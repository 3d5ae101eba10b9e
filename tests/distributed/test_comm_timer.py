"""CommTimer: each collective's time lands under its mesh dimension, waits included, and nothing else is counted.

Four gloo ranks on a (dp 2, tp 2) mesh. In each check one peer sleeps before joining a collective, so the other
rank of that group spends at least the sleep blocked in it: that time must show under the group's dimension, and
only there (each check's other dimensions stay below a bound well under the sleep)."""

import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from tests.launch import spawn
from torchpre.distributed.comm_timer import CommTimer
from torchpre.parallel.context_parallel import ContextParallel
from torchpre.training.job import CONTEXT_PARALLEL_KERNELS

SLEEP_S = 0.3
MEASURED_S = 0.2  # a rank blocked behind SLEEP_S counts at least this (scheduling can shorten the wait a little)
QUIET_S = 0.1  # a dimension that did not wait for a sleeper counts less than this


def _late(mesh: DeviceMesh, dim: str) -> None:
    """Rank 1 of `dim` arrives late to the next collective on it."""
    if mesh.get_local_rank(dim) == 1:
        time.sleep(SLEEP_S)


def _check_kinds(timer: CommTimer, mesh: DeviceMesh, waited: str) -> None:
    """The rank that waited for its late peer counted it under `waited`; the other dimension stayed quiet."""
    totals = timer.totals()
    waiting_rank = mesh.get_local_rank(waited) == 0
    other = "tp" if waited == "dp" else "dp"
    if waiting_rank:
        assert totals[waited] >= MEASURED_S, (waited, totals)
    assert totals[other] < QUIET_S, (waited, totals)
    assert totals["total"] >= sum(v for k, v in totals.items() if k != "total") - 1e-9


def _check_comm_timer(_: DeviceMesh) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    timer = CommTimer(torch.device("cpu"), [mesh])
    assert timer.kinds_in_use == ["dp", "tp"]
    original = dist.all_reduce
    x = torch.ones(4)
    with timer.installed():
        assert dist.all_reduce is not original

        _late(mesh, "dp")  # a synchronous c10d collective
        dist.all_reduce(x, group=mesh.get_group("dp"))
        _check_kinds(timer, mesh, "dp")

        _late(mesh, "tp")  # an asynchronous one: the time is in wait()
        dist.all_reduce(x, group=mesh.get_group("tp"), async_op=True).wait()
        _check_kinds(timer, mesh, "tp")

        _late(mesh, "dp")  # point-to-point, as the pipeline schedules send activations
        peer = mesh.get_group("dp")
        other = 1 - mesh.get_local_rank("dp")
        ops = [
            dist.P2POp(dist.isend, x, group=peer, group_peer=other),
            dist.P2POp(dist.irecv, torch.empty(4), group=peer, group_peer=other),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        _check_kinds(timer, mesh, "dp")

        _late(mesh, "tp")  # a functional collective, waited when its result is used
        summed = funcol.all_reduce(x, "sum", (mesh, 1))
        assert torch.equal(summed + 0, torch.full((4,), 2.0 * 2 * 2))  # x was summed over dp twice before
        _check_kinds(timer, mesh, "tp")

        _late(mesh, "tp")  # DTensor's redistribution, as tensor parallelism runs it
        sharded = distribute_tensor(torch.arange(8.0), mesh["tp"], [Shard(0)], src_data_rank=None)
        assert torch.equal(sharded.redistribute(mesh["tp"], [Replicate()]).to_local() + 0, torch.arange(8.0))
        _check_kinds(timer, mesh, "tp")

        dist.barrier()
        timer.totals()
        if dist.get_rank() == 1:
            time.sleep(SLEEP_S)
        dist.all_reduce(x)  # the world group is no mesh dimension: `other`, still part of the total
        totals = timer.totals()
        if dist.get_rank() != 1:
            assert totals["other"] >= MEASURED_S and totals["total"] >= MEASURED_S, totals
        assert totals["dp"] < QUIET_S and totals["tp"] < QUIET_S, totals

        with timer.paused():  # validation and checkpoints: not counted
            _late(mesh, "dp")
            dist.all_reduce(x, group=mesh.get_group("dp"))
        assert timer.totals()["total"] < QUIET_S
    assert dist.all_reduce is original and dist.distributed_c10d.all_reduce is original


def test_collective_time_is_counted_under_its_mesh_dimension(tmp_path):
    spawn(_check_comm_timer, world_size=4, store_path=tmp_path / "store")


def test_dimensions_in_use_and_one_group_for_two_dimensions(tmp_path):
    spawn(_check_shared_group, world_size=2, store_path=tmp_path / "store")


def _check_shared_group(_: DeviceMesh) -> None:
    """Sizes of 1 communicate nothing. Expert parallelism over all of dp gets dp's group from torch: its
    all-to-all is still ep's, and the gradient all-reduce dp's."""
    mesh = init_device_mesh("cpu", (1, 2, 1), mesh_dim_names=("pp", "dp", "tp"))
    expert = init_device_mesh("cpu", (1, 1, 2, 1), mesh_dim_names=("pp", "edp", "ep", "tp"))
    timer = CommTimer(torch.device("cpu"), [mesh, expert])
    assert timer.kinds_in_use == ["dp", "ep"]
    with timer.installed():
        for dim, collective in (("dp", dist.all_reduce), ("ep", dist.all_to_all_single)):
            if dist.get_rank() == 1:
                time.sleep(SLEEP_S)
            tensor = torch.ones(2)
            args = (torch.empty(2), tensor) if dim == "ep" else (tensor,)
            collective(*args, group=(mesh if dim == "dp" else expert).get_group(dim))
            totals = timer.totals()
            if dist.get_rank() == 0:
                assert totals[dim] >= MEASURED_S, (dim, totals)
            assert totals["ep" if dim == "dp" else "dp"] < QUIET_S, (dim, totals)


def test_context_parallel_gathers_count_as_cp_on_the_group_they_share_with_dp(tmp_path):
    spawn(_check_context_parallel, world_size=2, store_path=tmp_path / "store")


def _check_context_parallel(_: DeviceMesh) -> None:
    """cp2 with dp 1: the gradient reduction's dp group (dp x cp) and cp's are the same ranks, one group from
    torch. Context parallelism's key/value all-gathers (`ContextParallel.attend`) count as cp, the data-parallel
    all-reduce as dp; a job without cp has no cp kind."""
    mesh = init_device_mesh("cpu", (1, 2, 1), mesh_dim_names=("pp", "dp", "tp"))
    context = init_device_mesh("cpu", (1, 1, 2, 1), mesh_dim_names=("pp", "dp", "cp", "tp"))
    assert CommTimer(torch.device("cpu"), [mesh]).kinds_in_use == ["dp"]
    timer = CommTimer(torch.device("cpu"), [mesh, context])
    assert timer.kinds_in_use == ["dp", "cp"]
    cp = ContextParallel(context["cp"], 8, torch.device("cpu"), CONTEXT_PARALLEL_KERNELS)
    q, k, v = (torch.randn(1, 4, 2, 4, requires_grad=True) for _ in range(3))
    with timer.installed():
        _late(context, "cp")
        cp.attend(q, k, v).sum().backward()
        totals = timer.totals()
        if context.get_local_rank("cp") == 0:
            assert totals["cp"] >= MEASURED_S, totals
        assert totals["dp"] < QUIET_S, totals

        _late(mesh, "dp")
        dist.all_reduce(k.grad, group=mesh.get_group("dp"))
        totals = timer.totals()
        if mesh.get_local_rank("dp") == 0:
            assert totals["dp"] >= MEASURED_S, totals
        assert totals["cp"] < QUIET_S, totals


def test_fsdp_waits_for_a_timed_asynchronous_all_gather(tmp_path):
    spawn(_check_fsdp_async_unshard, world_size=2, store_path=tmp_path / "store")


def _check_fsdp_async_unshard(_: DeviceMesh) -> None:
    """FSDP2 waits for an asynchronous all-gather only when its Work is a `dist.Work` (the pipeline schedules with two
    stages per rank prefetch each stage with `unshard(async_op=True)`): under the timer it must still gather every
    value, even when its peer joins late. Without the wait the late peer's half is read before it arrives (measured:
    garbage and NaN, so a ZeRO-3 dp2 x pp2 Interleaved1F1B run diverged at its first step)."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    full = torch.randn(8, 4)
    layer = nn.Linear(4, 8, bias=False)
    with torch.no_grad():
        layer.weight.copy_(full)
    fully_shard(layer, mesh=mesh)
    timer = CommTimer(torch.device("cpu"), [mesh])
    with timer.installed():
        assert isinstance(dist.all_reduce(torch.ones(1), async_op=True), dist.Work)
        _late(mesh, "dp")
        layer.unshard(async_op=True).wait()
        assert torch.equal(layer.weight, full)
    if dist.get_rank() == 0:  # it waited for its late peer, and counted that as dp
        assert timer.totals()["dp"] >= MEASURED_S
    layer.reshard()
