"""What one microbatch's forward and backward cost, counted by running them, possibly on the meta device.

`probe_microbatch` runs a module's forward and backward once under `ProbeMode`, the storage counter that
bench/memory.py measures with (`TensorMemory`) extended with FLOP, byte, op and collective counts. With the module
and its inputs on the meta device nothing is computed and no data is held, yet every op produces its true output
shapes, so the counts are those of a real run: the dry run and the planner predict activation memory by counting,
not by a formula that can drift from the model.

One difference between meta and a real CPU run is undone here: SDPA chooses its kernel by device, and meta has
no choice, so it would run the math backend and keep the [batch, heads, seq, seq] probabilities for backward.
The probe runs meta attention as the CPU flash kernel instead (`meta_flash_attention`): what a CPU run picks,
and what flash attention keeps on a GPU (the output and the log-sum-exp), so meta and CPU count the same bytes.

One difference between CPU (or meta) and CUDA is undone too: torch's RMSNorm (`F.rms_norm`) runs on CUDA as one fused
kernel whose backward keeps the input, an fp32 reciprocal RMS per row and the weight; on CPU and meta it is a
decomposition whose autograd keeps an fp32 copy of the input and the fp32 normalized output, 4 x the bytes of a bf16
input. The probe runs it as the CUDA kernel keeps it (`cuda_rms_norm`), on meta and CPU alike, so a probe counts what
a GPU run saves, while a CPU run outside the probe saves the decomposition's.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count, shape_wrapper

from torchpre.planner.tensor_memory import TensorMemory

aten = torch.ops.aten

_MATMUL_OPS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten._scaled_mm}
_COLLECTIVE_NAMESPACES = {"_c10d_functional", "_c10d_functional_autograd", "c10d"}
_C10D_INPUTS = ("input_tensor", "input_tensors", "input", "inputs")
_NOT_COLLECTIVES = {"wait_tensor", "_wrap_tensor_autograd", "monitored_barrier_"}


def _query_heads(query: torch.Size, kv: torch.Size) -> tuple[int, ...]:
    """A key or value shape with the query's head count: grouped-query attention costs as many FLOPs as
    repeating each key/value head for its queries, and torch 2.11's formulas reject unequal head counts."""
    return (*kv[:-3], query[-3], *kv[-2:])


def _causal_share(query: torch.Size, key: torch.Size) -> float:
    """The share of the [queries, keys] scores a causal kernel computes, the mask aligned to the lower right (the
    queries are the last positions of the keys' sequence: one process's square, or a context-parallel chunk over
    the keys up to it): flash kernels skip the masked blocks."""
    queries, keys = query[-2], key[-2]
    return 1 - (queries - 1) / (2 * keys)


@shape_wrapper
def _sdpa_for_cpu_flop(query, key, value, dropout_p=0.0, is_causal=False, *, out_shape=None, **kwargs) -> int:
    flops = sdpa_flop_count(query, _query_heads(query, key), _query_heads(query, value))
    return round(flops * _causal_share(query, key)) if is_causal else flops


@shape_wrapper
def _sdpa_for_cpu_backward_flop(
    grad_out, query, key, value, out, logsumexp, dropout_p=0.0, is_causal=False, *, out_shape=None, **kwargs
) -> int:
    flops = sdpa_backward_flop_count(grad_out, query, _query_heads(query, key), _query_heads(query, value))
    return round(flops * _causal_share(query, key)) if is_causal else flops


# torch's formulas (matmuls, convolutions, the GPU attention kernels) and the CPU flash kernel's, which torch
# lacks. Causal attention counts the scores its kernel computes (`_causal_share`), not the whole score matrix
# torch's formulas count, so that one process and context parallelism, whose kernels both skip the masked half,
# compare fairly.
_FLOP_FORMULAS = {
    **flop_registry,
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_for_cpu_flop,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_for_cpu_backward_flop,
}


@dataclass(frozen=True)
class ProbedCollective:
    """One collective op as this rank issued it: `op` ("namespace.name", e.g. "_c10d_functional.all_reduce"),
    the size of its process group, and `bytes`, the bytes of this rank's input tensors (for an all-gather the
    local shard, for a reduce-scatter the whole tensor). `group_stride`: the distance between the group's
    consecutive ranks, which tells apart mesh dimensions of the same size (tp's 1, cp's tp)."""

    op: str
    group_size: int
    bytes: int
    group_stride: int = 1


@dataclass
class ActivationProbe:
    """The counts of one forward + backward of one microbatch on this rank. Bytes are per rank (the plain
    tensors, or DTensors' local shards); "start" is the live total when the probe began, which excludes the
    module's parameters and buffers and the inputs (they exist before it).

    - `saved_bytes`: live bytes at the first op of backward minus start: what autograd keeps for backward (the
      forward's activations, the output without a `loss_fn`, the loss's own saved tensors with one),
      activation checkpointing's target.
    - `transient_bytes`: the peak of live bytes during forward and backward minus start minus `saved_bytes`
      (at least 0): temporaries on top of the saved activations, recomputation under checkpointing included.
      Parameter gradients that are still alive when the probe ends are left out of the peak (`grad_bytes`);
      gradients freed during backward (e.g. by a bucketing hook) are transient.
    - `transient_trace`: live bytes minus start minus `saved_bytes` after each allocation (without those gradients):
      `transient_bytes` is its maximum, at least 0. Each entry is a sum of tensor sizes, so where every size is
      affine in something (the microbatch size, 1 / cp), so is each entry, and the planner interpolates the trace
      entry by entry, then takes the maximum: the peak itself is not affine, as the moment it falls on can move.
    - `recomputed_trace`: beside each `transient_trace` entry, the live bytes of the storages that activation
      checkpointing's recomputation made (ops run with grad enabled inside backward, as checkpoint reruns a block's
      forward; ops inside an autograd.Function's forward run without grad and are not among them): at the peak of
      a checkpointed block's backward, what its recomputation keeps for it, which a compiled block keeps less of.
    - `grad_bytes`: bytes of the parameter `.grad` tensors created by this backward and still alive at the end.
    - `flops`: FLOPs of forward and backward (recomputation included) by torch's formulas: matmuls,
      convolutions and attention; elementwise ops are not counted. Causal attention counts the scores below
      the diagonal only (flash kernels skip the masked blocks; a masked kernel counts every score), and its
      backward recomputes the scores (as flash attention does).
    - `matmul_flops`: the part of `flops` done by matmuls (mm, addmm, bmm, baddbmm), i.e. without attention.
    - `fp8_flops`: the part of `matmul_flops` done by `aten._scaled_mm`, the FP8 tensor-core matmul torchao's float8
      linears call (quantize.linear): what runs at the FP8 peak.
    - `fp8_operand_elements`: elements of the FP8 operands of those matmuls: each was cast from high precision by
      torchao (an amax reduction and a scaled cast), which torch.compile fuses into kernels that move a fixed number
      of bytes per element (`torchpre.planner.time_model.FUSED_FP8_CAST_BYTES`).
    - `other_bytes`: bytes of the outputs written by all other non-view ops (elementwise, norms, copies,
      embedding lookups): the memory-bound traffic.
    - `op_counts`: how many times each op ran on plain tensors, views included, by name such as "aten.mm"
      (`ops` is their sum: the per-op overhead term). DTensor ops count as the local ops they run.
    - `collectives`: the collectives this rank issued, in order (e.g. DTensor's redistributes under tensor
      parallelism).
        - `subclass_ops`: ops dispatched on tensor subclasses (DTensor) before they run as the local ops counted
      above: each costs Python-side sharding propagation on top of them.
    """

    saved_bytes: int
    transient_bytes: int
    grad_bytes: int
    flops: int
    matmul_flops: int
    other_bytes: int
    op_counts: Counter[str]
    collectives: list[ProbedCollective]
    subclass_ops: int = 0
    fp8_flops: int = 0
    transient_trace: tuple[int, ...] = ()
    fp8_operand_elements: int = 0
    recomputed_trace: tuple[int, ...] = ()

    @property
    def ops(self) -> int:
        return sum(self.op_counts.values())


class ProbeMode(TensorMemory):
    """`TensorMemory` that also counts FLOPs, non-matmul output bytes, ops and collectives, and keeps the live
    total after each new allocation (with which storages were new) to find the peak without the parameter
    gradients that outlive the probe."""

    def __init__(self, devices: tuple[str, ...] = ("meta", "cpu")) -> None:
        super().__init__(devices)
        self.flops = self.matmul_flops = self.fp8_flops = self.other_bytes = self.fp8_operand_elements = 0
        self.op_counts: Counter[str] = Counter()
        self.collectives: list[ProbedCollective] = []
        self.live_trace: list[int] = []  # live bytes after each counted allocation
        self.subclass_ops = 0  # ops dispatched on tensor subclasses (DTensor), before they run their local ops
        self.created_at: dict[int, int] = {}  # id(storage) -> its index in live_trace
        self.recomputed: set[int] = set()  # id(storage) of those made by recomputation in backward
        self.recomputed_live = 0
        self.recomputed_trace: list[int] = []  # recomputation's live bytes after each counted allocation

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is NotImplemented and self.counting():
            self.subclass_ops += 1
        if out is NotImplemented or not self.counting():
            return out
        self.op_counts[str(func.overloadpacket)] += 1
        packet = func.overloadpacket
        if packet in _FLOP_FORMULAS:
            flops = _FLOP_FORMULAS[packet](*args, **kwargs, out_val=out)
            self.flops += flops
            if packet in _MATMUL_OPS:
                self.matmul_flops += flops
            if packet == aten._scaled_mm:
                self.fp8_flops += flops
                self.fp8_operand_elements += args[0].numel() + args[1].numel()
        elif func.namespace in _COLLECTIVE_NAMESPACES:
            if packet._qualified_op_name.split("::")[1] not in _NOT_COLLECTIVES:
                self.collectives.append(_collective(func, args, kwargs))
        elif not func.is_view:
            self.other_bytes += sum(_nbytes(leaf) for leaf in tree_leaves(out) if isinstance(leaf, Tensor))
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        """An entry of the trace per allocation that moved the live total. A view of a counted storage moves
        nothing, and a view op's outputs are as many as its split makes (`chunk(cp)`: cp), so counting them would
        give probes at two degrees traces of different lengths, which do not interpolate; the entry it would add
        equals the live total since the last entry less any frees, never above that entry, so the maximum (the
        transient) is the same without it."""
        key = id(storage)
        with self._lock:
            before = self._sizes.get(key)
            super()._track(storage)
            if self._sizes[key] == before:
                return
            if before is None:
                self.created_at[key] = len(self.live_trace)
                if _recomputing():
                    self.recomputed.add(key)
            if key in self.recomputed:
                self.recomputed_live += self._sizes[key] - (before or 0)
            self.live_trace.append(self.live)
            self.recomputed_trace.append(self.recomputed_live)

    def _free(self, key: int) -> None:
        with self._lock:
            if key in self.recomputed:
                self.recomputed.discard(key)
                self.recomputed_live -= self._sizes[key]
            super()._free(key)

    def counts(
        self,
        saved_bytes: int,
        transient_bytes: int,
        grad_bytes: int,
        transient_trace: tuple[int, ...] = (),
        recomputed_trace: tuple[int, ...] = (),
    ) -> ActivationProbe:
        """What this mode counted, with the byte figures its caller derived from it."""
        return ActivationProbe(
            saved_bytes=saved_bytes,
            transient_bytes=transient_bytes,
            grad_bytes=grad_bytes,
            flops=self.flops,
            matmul_flops=self.matmul_flops,
            other_bytes=self.other_bytes,
            op_counts=self.op_counts,
            collectives=self.collectives,
            subclass_ops=self.subclass_ops,
            fp8_flops=self.fp8_flops,
            transient_trace=transient_trace,
            fp8_operand_elements=self.fp8_operand_elements,
            recomputed_trace=recomputed_trace,
        )

    def tracks(self, storage: torch.UntypedStorage) -> bool:
        """Whether `storage` is counted (made on one of `devices` by an op this mode saw) and alive."""
        return id(storage) in self._sizes

    def trace_without(self, storages: list[torch.UntypedStorage]) -> list[int]:
        """Live bytes after each allocation of the probe if `storages` (made during it, alive at its end) had
        never been allocated: each is subtracted from the moment it was created on."""
        held = [0] * (len(self.live_trace) + 1)
        for storage in storages:
            held[self.created_at[id(storage)]] += storage.nbytes()
        trace, running = [], 0
        for index, live in enumerate(self.live_trace):
            running += held[index]
            trace.append(live - running)
        return trace


def _recomputing() -> bool:
    """Whether an op runs in activation checkpointing's recomputation: inside backward (an autograd graph task),
    whose own ops run without grad, with grad enabled, as torch.utils.checkpoint reruns the forward."""
    return torch._C._current_graph_task_id() != -1 and torch.is_grad_enabled()


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _collective(func, args: tuple, kwargs: dict) -> ProbedCollective:
    """The op, group size and input bytes of a functional (`group_name`) or c10d (ProcessGroup) collective."""
    values = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
    if "group_name" in values:
        group = _resolve_process_group(values["group_name"])
    else:  # c10d ops take the ProcessGroup itself, boxed as a ScriptObject
        group = ProcessGroup.unbox(values["process_group"])
    # The input: c10d's gathers, scatters and all-to-alls take their output first, the in-place ones their tensors.
    sent = next((name for name in _C10D_INPUTS if name in values), func._schema.arguments[0].name)
    nbytes = sum(_nbytes(t) for t in tree_leaves(values[sent]) if isinstance(t, Tensor))
    name = func.overloadpacket._qualified_op_name.replace("::", ".")
    ranks = sorted(dist.get_process_group_ranks(group))
    return ProbedCollective(name, group.size(), nbytes, ranks[1] - ranks[0] if len(ranks) > 1 else 1)


@contextmanager
def meta_flash_attention() -> Iterator[None]:
    """Runs `F.scaled_dot_product_attention` on plain meta tensors as the CPU flash kernel
    (`aten._scaled_dot_product_flash_attention_for_cpu`), as SDPA's CPU dispatch does for 4-D floating-point
    inputs. SDPA chooses its backend by a per-device stub called inside the op (not an op that a dispatch mode
    could answer), and meta has none, so it would fall back to the math backend.

    The function is replaced in `torch.nn.functional` for the duration (callers that look it up there at call
    time, as torchpre's models do, see the replacement), rather than by a TorchFunctionMode: a mode is popped
    while it handles `Tensor.backward`, so activation checkpointing's recomputation would run without it.
    """
    original = F.scaled_dot_product_attention

    def attention(query: Tensor, key: Tensor, value: Tensor, *args, **kwargs) -> Tensor:
        if _flash_applies((query, key, value)):
            return _flash_attention_for_cpu(query, key, value, *args, **kwargs)
        return original(query, key, value, *args, **kwargs)

    F.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def _flash_applies(qkv: tuple) -> bool:
    """As SDPA's CPU dispatch: the flash kernel takes 4-D floating-point inputs whose heads are all one size (multi-
    head latent attention's values are narrower than its queries: the math kernel runs it, and the flash kernel's
    meta function would return the queries' width)."""
    return all(
        isinstance(t, Tensor) and not is_traceable_wrapper_subclass(t) and t.device.type == "meta"
        and t.dim() == 4 and t.is_floating_point() and t.shape[-1] == qkv[0].shape[-1]
        for t in qkv
    )


def _flash_attention_for_cpu(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """SDPA's flash branch for CPU, which handles grouped-query attention natively (`enable_gqa` needs nothing
    more); a boolean mask becomes an additive one in the query's dtype first, as SDPA converts it."""
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        zero = torch.scalar_tensor(0.0, dtype=query.dtype, device=attn_mask.device)
        minus_inf = torch.scalar_tensor(-math.inf, dtype=query.dtype, device=attn_mask.device)
        attn_mask = torch.where(attn_mask, zero, minus_inf)
    out, _ = aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )
    return out


@contextmanager
def cuda_rms_norm() -> Iterator[None]:
    """Runs `F.rms_norm` (torch's `nn.RMSNorm`) as `_FusedRMSNorm`, saving for backward what CUDA's fused kernel
    (`aten._fused_rms_norm`) saves: the input, the fp32 reciprocal RMS per row and the weight. Replaced in
    `torch.nn.functional` for the duration, as `meta_flash_attention` replaces attention (and for the same reason:
    checkpointing's recomputation runs in backward, where a mode would be popped). Other norms (transformers' own
    RMSNorm classes) are decompositions on a GPU too, and run as they are."""
    original = F.rms_norm

    def rms_norm(input: Tensor, normalized_shape: list[int], weight: Tensor | None = None, eps: float | None = None):
        return _FusedRMSNorm.apply(input, tuple(normalized_shape), weight, eps)

    F.rms_norm = rms_norm
    try:
        yield
    finally:
        F.rms_norm = original


class _FusedRMSNorm(torch.autograd.Function):
    """RMSNorm with CUDA's saved tensors and exact gradients on any device: the forward is torch's own
    (`aten._fused_rms_norm`, which returns the reciprocal RMS it computed), the backward its formula in fp32 (fp64 for
    fp64 inputs), as the CUDA kernel accumulates."""

    @staticmethod
    def forward(ctx, input: Tensor, normalized_shape: tuple[int, ...], weight: Tensor | None, eps: float | None):
        output, rstd = aten._fused_rms_norm(input, list(normalized_shape), weight, eps)
        ctx.save_for_backward(input, rstd, weight)
        ctx.norm_dims = tuple(range(-len(normalized_shape), 0))
        return output

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        input, rstd, weight = ctx.saved_tensors
        dims = ctx.norm_dims
        compute = torch.promote_types(input.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
        # In place where it can be: two working copies of the input's size at a time (CUDA's kernel needs none).
        normalized = input.to(compute, copy=True).mul_(rstd)
        grad = grad_output.to(compute, copy=True)
        grad_weight = None
        if weight is not None and ctx.needs_input_grad[2]:
            leading = tuple(range(grad.dim() - len(dims)))
            product = grad * normalized
            grad_weight = (product.sum(leading) if leading else product).to(weight.dtype)
            del product
        grad_input = None
        if ctx.needs_input_grad[0]:
            if weight is not None:
                grad.mul_(weight)
            projection = (grad * normalized).mean(dims, keepdim=True)
            grad_input = grad.sub_(normalized.mul_(projection)).mul_(rstd).to(input.dtype)
        return grad_input, None, grad_weight, None


@contextmanager
def _uncounted(mode: TensorMemory) -> Iterator[None]:
    """Ops run inside are not seen by `mode` (its devices emptied for the duration)."""
    devices, mode.devices = mode.devices, ()
    try:
        yield
    finally:
        mode.devices = devices


def probe_microbatch(
    module: nn.Module,
    args: tuple,
    kwargs: dict | None = None,
    *,
    loss_fn: Callable[[Tensor], Tensor] | None = None,
    devices: tuple[str, ...] = ("meta", "cpu"),
) -> ActivationProbe:
    """Runs `module(*args, **kwargs)` and its backward once and counts them (see `ActivationProbe`).

    The backward starts from `loss_fn(output)` when given (the last pipeline stage: logits to loss), as the
    trainer runs it: the output is not held beyond what the loss saves (cross-entropy keeps its log-softmax, not
    the logits). Else from the output, held until backward as a pipeline stage holds it, with a gradient of ones
    (what the next stage sends back; like the inputs it is the caller's, and not counted); the output must then be
    one tensor. The module runs where it lives: on meta nothing is computed. Storages are counted on `devices`.
    Parameter gradients this backward creates are left in `.grad`.
    """
    params = [p for p in module.parameters() if p.requires_grad]
    had_grad = {id(p) for p in params if p.grad is not None}
    mode = ProbeMode(devices)
    with meta_flash_attention(), cuda_rms_norm(), mode:
        mode.begin_step()
        if loss_fn is not None:
            loss_fn(module(*args, **(kwargs or {}))).backward()  # the output lives only as long as the loss needs
        else:
            output = module(*args, **(kwargs or {}))
            with _uncounted(mode):
                grad = torch.ones_like(output)
            output.backward(grad)
            del output
    grads = [storage for storage in _new_grad_storages(params, had_grad) if mode.tracks(storage)]
    saved = mode.at_backward - mode.step_start
    beyond_saved = tuple(live - mode.step_start - saved for live in mode.trace_without(grads))
    grad_bytes = sum(s.nbytes() for s in grads)
    return mode.counts(saved, max((0, *beyond_saved)), grad_bytes, beyond_saved, tuple(mode.recomputed_trace))


def _new_grad_storages(params: list[Tensor], had_grad: set[int]) -> list[torch.UntypedStorage]:
    """The distinct storages (local shards for DTensors) of the `.grad`s that the probe created."""
    storages: dict[int, torch.UntypedStorage] = {}
    for param in params:
        if id(param) in had_grad or param.grad is None:
            continue
        grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        storages[id(grad.untyped_storage())] = grad.untyped_storage()
    return list(storages.values())
