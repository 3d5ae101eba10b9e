"""Wall time inside each mesh dimension's collectives: the `time/comm_{dp,tp,pp,ep,cp}_s` metrics.

torch has no hook that times collectives on every backend (NCCL's completion hooks skip gloo, and a dispatch
mode would slow every operator), so while a `CommTimer` is installed it wraps the Python entry points of
torch.distributed's collectives and of the functional collectives DTensor uses, and looks up which mesh
dimension each call's process group is. A synchronous call is timed as a whole; an asynchronous one is timed
when it is issued and again when it is waited for (`Work.wait`, or the functional collectives' `wait_tensor`),
so the time counts what the caller spent blocked, not what overlapped with compute. Point-to-point receives of
the pipeline count their wait for the peer, so `comm_pp` includes the bubble the peer's compute causes.

Not seen: collectives inside `torch.compile`d graphs (they are graph nodes, not calls), and the backward
collectives of the functional collectives' own autograd (the expert all-to-all's backward), whose waits count as
`other`: not reported, but part of the communication a rank's busy time excludes (`total`).
"""

import functools
import inspect
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh

from torchpre.distributed.clock import SpanClock

OTHER = "other"  # a group that is no mesh dimension of size > 1: the world, say

# torch.distributed's collectives; each one that the installed torch has is wrapped.
C10D_COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single", "broadcast", "reduce",
    "gather", "scatter", "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier",
)
# The functional collectives (DTensor's redistributions, the expert all-to-all); waited in `wait_tensor`.
FUNCTIONAL_COLLECTIVES = (
    "all_reduce", "all_gather_tensor", "all_gather_tensor_autograd", "all_gather_single",
    "all_gather_single_autograd", "reduce_scatter_tensor", "reduce_scatter_tensor_autograd",
    "reduce_scatter_single", "reduce_scatter_single_autograd", "all_to_all_single", "all_to_all_single_autograd",
    "all_reduce_coalesced", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced",
    "broadcast", "permute_tensor",
)


_COUNTED_AS: ContextVar[str | None] = ContextVar("counted_as", default=None)


@contextmanager
def counted_as(kind: str) -> Iterator[None]:
    """Collectives issued inside count as `kind` where their group serves it: torch gives mesh dimensions over the
    same ranks one group (cp and dp when the gradients are reduced over cp alone), so only the caller knows that a
    gather on it is context parallelism's."""
    token = _COUNTED_AS.set(kind)
    try:
        yield
    finally:
        _COUNTED_AS.reset(token)


def dimension_kind(name: str) -> str:
    """The metric a mesh dimension's collectives count under: dp for every data-parallel flavour (dp,
    dp_replicate, dp_shard, edp, edp_shard)."""
    return name if name in ("tp", "pp", "ep", "cp") else "dp"


class CommTimer:
    """Seconds inside collectives per kind (dp, tp, pp, ep, cp, other) since the last `totals()`, while `installed`.

    `meshes` are the job's device meshes; a dimension of size 1 communicates nothing and has no kind. On CUDA
    the spans are events on the current stream (`SpanClock`): the time the stream waited for communication,
    read without a host sync until `totals()`.
    """

    def __init__(self, device: torch.device, meshes: Iterable[DeviceMesh]) -> None:
        self.clock = SpanClock(device)
        self.kinds_in_use: list[str] = []
        self._kinds_of_group: dict[str, list[str]] = {}
        for mesh in meshes:
            for name in mesh.mesh_dim_names:
                if mesh.size(mesh.mesh_dim_names.index(name)) > 1:
                    kind = dimension_kind(name)
                    kinds = self._kinds_of_group.setdefault(mesh.get_group(name).group_name, [])
                    for known in (kinds, self.kinds_in_use):
                        if kind not in known:
                            known.append(kind)
        self._pending: dict[int, str] = {}  # a functional collective's output buffer -> its kind, until waited
        self._paused = False

    def totals(self) -> dict[str, float]:
        """Seconds per kind since the last call: every kind in use (0 when it did not communicate), `other`
        when something else did, and `total`, their sum."""
        seconds = self.clock.totals()
        per_kind = {kind: seconds.get(kind, 0.0) for kind in self.kinds_in_use}
        if OTHER in seconds:
            per_kind[OTHER] = seconds[OTHER]
        return per_kind | {"total": sum(seconds.values())}

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Collectives here are not counted: validation and checkpoint saves are not part of a step."""
        self._paused, was = True, self._paused
        try:
            yield
        finally:
            self._paused = was

    @contextmanager
    def installed(self) -> Iterator["CommTimer"]:
        """Wraps the collectives' entry points for the duration of the block, then puts the originals back."""
        originals: list[tuple[Any, str, Any]] = []
        try:
            for name in C10D_COLLECTIVES:
                if hasattr(c10d, name):
                    wrapper = self._wrap_c10d(getattr(c10d, name))
                    # The same object in both namespaces: P2POp checks its op against c10d's isend and irecv.
                    for module in (c10d, dist):
                        originals.append((module, name, getattr(module, name)))
                        setattr(module, name, wrapper)
            for name in FUNCTIONAL_COLLECTIVES:
                if hasattr(funcol, name):
                    originals.append((funcol, name, getattr(funcol, name)))
                    setattr(funcol, name, self._wrap_functional(getattr(funcol, name)))
            originals.append((funcol, "wait_tensor", funcol.wait_tensor))
            funcol.wait_tensor = self._wrap_wait_tensor(funcol.wait_tensor)
            yield self
        finally:
            for module, name, original in reversed(originals):
                setattr(module, name, original)
            self._pending.clear()

    def _kind(self, group: funcol.RANK_TYPES | None, collective: str) -> str:
        """The kind of a call of `collective` on `group`. torch gives dimensions over the same ranks one group
        (ep spanning all of dp, say; or cp when the gradients are reduced over cp alone): there an all-to-all is
        expert parallelism's, a call inside `counted_as(kind)` that kind's (context parallelism's key/value
        gathers), anything else the first dimension's (the order of the meshes' dimensions)."""
        if group is None:
            group = c10d._get_default_group()
        name = group.group_name if isinstance(group, dist.ProcessGroup) else funcol._resolve_group_name(group)
        kinds = self._kinds_of_group.get(name, [OTHER])
        if "ep" in kinds and collective.startswith("all_to_all"):
            return "ep"
        if (hint := _COUNTED_AS.get()) in kinds:
            return hint
        return kinds[0]

    def _span(self, kind: str):
        return self.clock.span(kind) if not self._paused else nullcontext()

    def _wrap_c10d(self, collective: Callable) -> Callable:
        signature, name = inspect.signature(collective), collective.__name__

        @functools.wraps(collective)
        def timed(*args, **kwargs):
            if name == "batch_isend_irecv":
                ops = args[0] if args else kwargs["p2p_op_list"]
                kind = self._kind(ops[0].group, name) if ops else OTHER
            else:
                kind = self._kind(signature.bind(*args, **kwargs).arguments.get("group"), name)
            with self._span(kind):
                result = collective(*args, **kwargs)
            if isinstance(result, list):
                return [_TimedWork(work, self, kind) if work is not None else None for work in result]
            return _TimedWork(result, self, kind) if isinstance(result, dist.Work) else result

        return timed

    def _wrap_functional(self, collective: Callable) -> Callable:
        signature, name = inspect.signature(collective), collective.__name__

        @functools.wraps(collective)
        def timed(*args, **kwargs):
            if torch.compiler.is_compiling():  # being traced into a compiled graph: a node there, not a call
                return collective(*args, **kwargs)
            kind = self._kind(signature.bind(*args, **kwargs).arguments.get("group"), name)
            with self._span(kind):
                result = collective(*args, **kwargs)
            for output in result if isinstance(result, list) else [result]:
                if isinstance(output, funcol.AsyncCollectiveTensor):
                    self._pending[_buffer(output.elem)] = kind
            return result

        return timed

    def _wrap_wait_tensor(self, wait_tensor: Callable) -> Callable:
        @functools.wraps(wait_tensor)
        def timed(tensor: torch.Tensor) -> torch.Tensor:
            if torch.compiler.is_compiling():
                return wait_tensor(tensor)
            with self._span(self._pending.pop(_buffer(tensor), OTHER)):
                return wait_tensor(tensor)

        return timed


def _buffer(tensor: torch.Tensor) -> int:
    """Identifies a functional collective's output buffer. Not the tensor: a view of a pending output (the
    all-gather along a dimension other than 0 returns one) is waited on as its own tensor, over the same storage."""
    return tensor.untyped_storage().data_ptr()


def _delegate(name: str) -> Callable:
    def method(self: "_TimedWork", *args, **kwargs) -> object:
        return getattr(self._work, name)(*args, **kwargs)

    method.__name__ = name
    return method


def _delegating_to_work(cls: type) -> type:
    """Gives `cls` each method of the installed torch's `Work` that it does not define as a call on `self._work`:
    a Python subclass would otherwise run the base class's, which know nothing of the wrapped collective."""
    for name, member in vars(dist.Work).items():
        internal = name.startswith(("__", "_pybind11")) or name == "unbox"  # pybind's own, and a static method
        if callable(member) and not internal and name not in vars(cls):
            setattr(cls, name, _delegate(name))
    return cls


@_delegating_to_work
class _TimedWork(dist.Work):
    """A collective's `Work` whose `wait()` counts as communication of its kind; every other method is the Work's.

    It is a `dist.Work` itself because callers tell an asynchronous collective by `isinstance(work, Work)` and wait
    for nothing else: FSDP2 copies out the parameters a pipeline schedule gathers ahead (`unshard(async_op=True)`,
    two stages per rank) only after waiting on such a Work, and read the all-gather's output before it arrived
    when this was a plain wrapper."""

    def __init__(self, work: dist.Work, timer: CommTimer, kind: str) -> None:
        super().__init__()
        self._work, self._timer, self._kind = work, timer, kind

    def wait(self, *args, **kwargs) -> bool:
        with self._timer._span(self._kind):
            return self._work.wait(*args, **kwargs)

    @property
    def timeout(self) -> timedelta:
        return self._work.timeout
