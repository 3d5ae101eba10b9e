"""Counts, on CPU, the calls that would make the host wait for a GPU: the host-sync budget's instrument.

On CUDA the host runs ahead of the device until it needs a value the device computes. On CPU nothing waits, so
`HostSyncCounter` records the calls instead, each with the Python stack that made it:
- ops that read a value on the host: `item()`, `bool(t)` / `if t:`, `int(t)`, `float(t)` (all
  `aten._local_scalar_dense`), `torch.equal`, `torch.allclose`;
- ops whose output size depends on the values (the host must read that size): `nonzero` (and one-argument
  `torch.where`, `argwhere`), `masked_select`, boolean-mask indexing and assignment, `unique`, `bincount`,
  `repeat_interleave` with a tensor of repeats and no `output_size`;
- copies to the host: `tolist()`, `numpy()`, `cpu()`, a blocking `to("cpu")`; and from host data to a device,
  `torch.tensor(data, device=...)` / `torch.as_tensor` (blocking from pageable memory). On CPU these dispatch
  nothing (`tolist` reads the memory directly, `cpu()` returns the tensor itself), so the functions are wrapped.

The ops are seen by a `TorchDispatchMode`: every op dispatched while counting, on plain tensors and DTensors, in
torch's Python code (DTensor redistribution, collectives, pipelining) and in the backward the autograd engine runs.
Blind spots: code that runs only on CUDA (e.g. `torch.cuda.synchronize()`, reading CUDA events), and a one-element
device tensor used as a mask-assignment value (taken for a host scalar, see `_is_masked_fill`).
"""

import contextlib
import functools
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch._dynamo
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Ops that return a host value, or whose output shape the host can only know by reading device memory.
_SYNCING_OPS = {
    aten._local_scalar_dense.default: "item()/bool()/int()/float()",
    aten.equal.default: "torch.equal",
    aten.allclose.default: "torch.allclose",
    aten.nonzero.default: "nonzero (torch.where(cond), argwhere)",
    aten.masked_select.default: "masked_select",
    aten._unique.default: "unique",
    aten._unique2.default: "unique",
    aten.unique_dim.default: "unique",
    aten.unique_consecutive.default: "unique_consecutive",
    aten.unique_dim_consecutive.default: "unique_consecutive",
    aten.bincount.default: "bincount",
}
_BOOL_MASK_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
_HELPER = str(Path(__file__).resolve())


@dataclass(frozen=True)
class HostSync:
    """One call that would block the host on a GPU: what, the innermost frame outside torch that led to it (the line
    of torchpre or of a test) and the innermost frames of its stack."""

    what: str
    site: str
    stack: tuple[str, ...]

    def describe(self) -> str:
        return f"{self.what} from {self.site}, stack:\n    " + "\n    ".join(self.stack)


# Frames of the machinery between a call and the mode that sees it (dynamo's wrapper of every mode).
_PLUMBING = (_HELPER, str(Path(torch._dynamo.__file__).parent), str(Path(torch.__file__).parent / "_compile.py"))
_TORCH = str(Path(torch.__file__).parent)


def _host_sync(what: str, depth: int = 10) -> HostSync:
    """`what`, made by the caller's stack (innermost first, without the counter's and dynamo's frames)."""
    frames = [
        f"{f.filename}:{f.lineno} in {f.name}"
        for f in reversed(traceback.extract_stack())
        if not f.filename.startswith(_PLUMBING)
    ]
    site = next((frame for frame in frames if not frame.startswith(_TORCH)), frames[0])
    return HostSync(what, site, tuple(frames[:depth]))


def _syncing_op(func, args: tuple, kwargs: dict) -> str | None:
    """What makes this op a host sync, or None."""
    if func in _SYNCING_OPS:
        return _SYNCING_OPS[func]
    if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
        return "repeat_interleave without output_size"
    if func in _BOOL_MASK_OPS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        masks = [i for i in indices if i is not None and i.dtype in (torch.bool, torch.uint8)]
        if masks and not (func is not aten.index.Tensor and _is_masked_fill(args, kwargs, masks)):
            return "boolean-mask indexing"
    return None


def _is_masked_fill(args: tuple, kwargs: dict, masks: list[torch.Tensor]) -> bool:
    """Whether an `index_put` is ATen's masked_fill case (no sync): one mask, no accumulation and a one-element host
    value, as `t[mask] = 0.0` makes on CUDA (Python puts the scalar on the host for exactly this). On CPU a
    one-element device tensor as the value cannot be told from it."""
    value = args[2] if len(args) > 2 else kwargs["values"]
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    return len(masks) == 1 and not accumulate and value.numel() == 1 and value.device.type == "cpu"


class _CountOps(TorchDispatchMode):
    def __init__(self, record: Callable[[str, tuple], None]) -> None:
        super().__init__()
        self._record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        what = _syncing_op(func, args, kwargs)
        if what is not None:
            self._record(f"{what} ({func})", args)
        return func(*args, **kwargs)


class HostSyncCounter:
    """Records host syncs while `counting()` is open; `pause()` excludes a span inside it (e.g. host-side data).

    `host_resident()`, called as counting starts, names tensors that stay in host memory on a GPU machine too
    (e.g. a torch optimizer's step counts): reading those waits for nothing, so calls on them alone are not counted.
    """

    def __init__(self, host_resident: Callable[[], Iterable[torch.Tensor]] = tuple) -> None:
        self.syncs: list[HostSync] = []
        self._active = False
        self._host_resident = host_resident
        self._host_ids: set[int] = set()

    def _record(self, what: str, args: tuple) -> None:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if self._active and not (tensors and all(id(t) in self._host_ids for t in tensors)):
            self.syncs.append(_host_sync(what))

    @contextlib.contextmanager
    def counting(self) -> Iterator["HostSyncCounter"]:
        resident = list(self._host_resident())  # held, so that their ids stay theirs while counting
        self._host_ids = {id(t) for t in resident}
        with _CountOps(self._record), self._wrapped_copies():
            self._active = True
            try:
                yield self
            finally:
                self._active = False

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        active, self._active = self._active, False
        try:
            yield
        finally:
            self._active = active

    @contextlib.contextmanager
    def _wrapped_copies(self) -> Iterator[None]:
        """Wraps the functions that copy between host and device without dispatching anything on CPU."""
        wrapped = [
            (torch.Tensor, "tolist", _always),
            (torch.Tensor, "numpy", _always),
            (torch.Tensor, "cpu", _always),
            (torch.Tensor, "to", _blocking_copy_to_host),
            (torch, "tensor", _built_on_a_device),
            (torch, "as_tensor", _built_on_a_device),
        ]
        originals = [(owner, name, getattr(owner, name)) for owner, name, _ in wrapped]

        def wrap(owner, name: str, is_sync: Callable[..., bool]):
            original = getattr(owner, name)

            @functools.wraps(original)
            def wrapper(first, *args, **kwargs):
                if not self._active or not is_sync(first, *args, **kwargs):
                    return original(first, *args, **kwargs)
                self._record(f"{owner.__name__}.{name}()", (first,) if isinstance(first, torch.Tensor) else ())
                with self.pause():  # the copy's own ops are this one sync
                    return original(first, *args, **kwargs)

            return wrapper

        try:
            for owner, name, is_sync in wrapped:
                setattr(owner, name, wrap(owner, name, is_sync))
            yield
        finally:
            for owner, name, original in originals:
                setattr(owner, name, original)


def _always(*args, **kwargs) -> bool:
    return True


def _built_on_a_device(data, *args, **kwargs) -> bool:
    """Whether `torch.tensor(data, ..., device=...)` copies host data to a device: a blocking copy from pageable
    memory on a GPU. On CPU the device cannot be told from the host, so any explicit device counts."""
    return not isinstance(data, torch.Tensor) and kwargs.get("device") is not None


def _blocking_copy_to_host(tensor: torch.Tensor, *args, **kwargs) -> bool:
    """Whether `tensor.to(*args, **kwargs)` copies to the CPU without `non_blocking=True`."""
    device = kwargs.get("device", args[0] if args else None)
    if not isinstance(device, str | torch.device) or torch.device(device).type != "cpu":
        return False
    return not kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
