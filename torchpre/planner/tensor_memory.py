"""Exact tensor-memory accounting by storage: what bench/memory.py measures and the dry run predicts with.

`TensorMemory` is a TorchDispatchMode: every storage an op creates while it is active is counted at its size until
its last reference dies (a weakref callback on the storage), so the running total is every tensor byte the ops
made (parameters, buffers, optimizer state, gradients, activations, temporaries) and its maximum is the CPU
counterpart of CUDA's `max_memory_allocated`. Counting `meta` storages too gives the same numbers without data.

Why not `torch.profiler(profile_memory=True)`: its CPU allocator total only counts frees made on profiled threads,
and gloo sometimes drops the last reference to a gradient bucket on its own thread, so that total drifts up by a
bucket at random steps. A weakref callback fires on any thread. What neither of them sees: scratch buffers that
kernels allocate internally (small on CPU). Ops on wrapper subclasses such as DTensor are declined
(`NotImplemented`), so that the subclass runs them on its plain local tensors with the mode still active: those
local tensors are what is counted, the per-rank bytes. The ops DTensor runs under a FakeTensorMode of its own to
propagate global shapes are passed through uncounted: they hold no memory of the job.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


class TensorMemory(TorchDispatchMode):
    """Live bytes of the storages on `devices` that ops create while active, their peak since `begin_step`, and
    the live bytes when autograd first runs an op in the step (the end of the forward)."""

    def __init__(self, devices: tuple[str, ...] = ("cpu",)) -> None:
        super().__init__()
        self.devices = devices
        self._lock = threading.RLock()  # frees arrive from gloo's threads too
        self._sizes: dict[int, int] = {}  # id(storage) -> bytes
        self._refs: dict[int, weakref.ref] = {}
        self.live = self.peak = self.step_start = 0
        self.at_backward: int | None = None
        self._fake_mode = _current_fake_mode()  # the job's own, if it runs under one

    def begin_step(self) -> None:
        with self._lock:
            self.step_start = self.peak = self.live
            self.at_backward = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _has_subclass((args, kwargs)):
            return NotImplemented  # the subclass runs it on local tensors, which come back here
        if not self.counting():
            return func(*args, **(kwargs or {}))
        if self.at_backward is None and torch._C._current_graph_task_id() != -1:
            self.at_backward = self.live
        out = func(*args, **(kwargs or {}))
        self.track_outputs(out, inputs=(args, kwargs))
        return out

    def counting(self) -> bool:
        """False while DTensor propagates shapes under a FakeTensorMode of its own (not the job's)."""
        return _current_fake_mode() is self._fake_mode

    def track_outputs(self, out, inputs=()) -> None:
        """Counts the storages of the plain tensors in `out` that live on one of `devices`, except those of an
        untracked input (a view or in-place result of a tensor made before the mode: a module's parameters, a
        batch passed in), which the op did not allocate."""
        aliased = {id(t.untyped_storage()) for t in self._plain(inputs)}
        for leaf in self._plain(out):
            storage = leaf.untyped_storage()
            if id(storage) in self._refs or id(storage) not in aliased:
                self._track(storage)

    def _plain(self, tree) -> list[torch.Tensor]:
        return [
            leaf
            for leaf in tree_leaves(tree)
            if isinstance(leaf, torch.Tensor) and leaf.device.type in self.devices
            and not is_traceable_wrapper_subclass(leaf)
        ]

    def _track(self, storage: torch.UntypedStorage) -> None:
        """Counts a new storage, or a known one's new size (ops with `out=` may resize it)."""
        key = id(storage)
        with self._lock:
            if key not in self._refs:
                self._refs[key] = weakref.ref(storage, lambda _, key=key: self._free(key))
            self.live += storage.nbytes() - self._sizes.get(key, 0)
            self._sizes[key] = storage.nbytes()
            self.peak = max(self.peak, self.live)

    def _free(self, key: int) -> None:
        with self._lock:
            self.live -= self._sizes.pop(key)
            del self._refs[key]


def _has_subclass(tree) -> bool:
    return any(is_traceable_wrapper_subclass(leaf) for leaf in tree_leaves(tree))


def _current_fake_mode() -> TorchDispatchMode | None:
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
