"""A torch optimizer on fp32 master weights, with its state replicated (ZeRO stage 0) or sharded over DP (stage 1),
and its gradients sharded too (stage 2).

Gradients are reduced over DP in flat buckets (`torchpre.optim.grad_buckets`): all-reduced (stage 0) or
reduce-scattered (stages 1-2), each bucket as soon as backward has produced its gradients, overlapping the rest
of backward. After the last backward they are finalised once per optimizer step, on this rank's fp32 DP shards:
partial sums over TP are reduced (norms under sequence parallel), copies of a weight tied across pipeline stages
are summed (both sums commute with the DP sum, and every TP and pp rank cuts its DP chunks alike, so doing them on
the shards is the same arithmetic on 1/dp of the data), the global norm is taken and the gradients clipped.
Each rank then steps the inner optimizer (any `torch.optim` class, see `torchpre.optim.registry`) on its fp32
master shard and the new values are copied (stage 0) or all-gathered (stages 1-2) into the parameters,
which may be bf16. The inner optimizer's per-parameter state tensors are shaped like its master shard, so they
are sharded and checkpointed exactly like the master.

Stages 1 and 2 shard every parameter over DP along its first dimension that tensor parallelism does not
shard, as `torch.chunk` does (DTensor's Shard semantics): a parameter's optimizer state is then a
plain 2-D-mesh DTensor (Shard over dp, the TP placement over tp), which checkpoints can reshard. A
tensor whose only dimension TP shards is cut along it again, within its TP-local part (`_StridedShard`).

Experts sharded by expert parallelism (DTensors on the 1-D `ep` mesh, Shard(0) over experts) form a second
domain: each expert lives on one rank of every ep group, so its gradient is reduced over the expert-data-
parallel group `edp` (the DP ranks holding the same experts) instead of all of DP, its ZeRO-1 shard is taken
over edp, and its state is a DTensor on the 2-D (edp, ep) mesh.
Memory per parameter (bytes: parameter + gradient + state), for AdamW's two moments: fp32 16, ZeRO-1 8 + 8/dp,
ZeRO-2 4 + 12/dp; bf16 parameters with fp32 gradients and masters 18, ZeRO-1 6 + 12/dp, ZeRO-2 2 + 16/dp.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from torchpre.distributed.collectives import (
    DEFAULT_BUCKET_BYTES,
    all_gather_into,
    all_reduce_tensors,
    rank_chunk,
)
from torchpre.errors import ConfigError
from torchpre.optim.grad_buckets import GradBuckets
from torchpre.parallel.grad_clip import clip_gradients_, global_grad_norm, sum_of_squares
from torchpre.parallel.pipeline import sync_tied_gradients


@dataclass
class _Entry:
    """One model parameter and what the optimizer keeps for it on this rank."""

    name: str
    param: nn.Parameter
    local: torch.Tensor  # the parameter's local (TP) tensor, sharing its storage
    tp_sharded: bool
    dim: int  # the dimension sharded over DP under ZeRO-1 and 2
    master: torch.Tensor  # fp32; a view of `local` when the parameter is fp32
    tp_partial: bool = False  # its gradient is a per-rank partial sum over TP
    expert: bool = False  # sharded over the ep mesh; reduced over edp instead of dp
    owns_master: bool = field(init=False)

    def __post_init__(self) -> None:
        # A separate master exists exactly when the parameter is not fp32 (`_entry`). Decided by dtype, not by
        # comparing storage pointers: those are 0 for every meta or fake tensor, where a dry run builds this.
        self.owns_master = self.master.dtype != self.local.dtype


# Whether a stage shards the optimizer state (and the masters) over DP: stages 1 and 2 keep the same state, so
# their checkpoints are the same bytes.
SHARDS_STATE = {0: False, 1: True, 2: True}


class DistributedOptimizer:
    """The optimizer of a (possibly TP-sharded, pipelined) model replicated over DP.

    `step()` finalises the gradients, steps the inner optimizer and writes the parameters; it returns the global
    gradient norm before clipping. `reduce_gradients()`, then `apply()` or `discard()`, is the same step
    for a caller that first checks the norm. `inner` is the torch optimizer over the master shards (for the LR
    scheduler), built by `build_inner(param_groups)`: matrices decay by `weight_decay`, vectors (norm gains,
    biases) do not. `state_mesh` is the 2-D (dp, tp) mesh the state is laid out on in `state_dict()`;
    `expert_state_mesh`, the 2-D (edp, ep) mesh of expert-parallel experts' state (None without experts).
    `parts[i]` is the pipeline part (index in `ParallelModel.parts`) of the i-th parameter (all 0 when None);
    `reduce_dtype`, `overlap_grad_reduce` and `zero2_accumulate_locally` configure the DP reduction (`GradBuckets`).
    """

    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        *,
        zero_stage: int,
        state_mesh: DeviceMesh,
        dp_group: dist.ProcessGroup,
        tp_group: dist.ProcessGroup,
        pp_group: dist.ProcessGroup,
        accumulate_in_fp32: bool,
        build_inner: Callable[[list[dict]], torch.optim.Optimizer],
        weight_decay: float,
        max_norm: float,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        tied: tuple[str, str] | None = None,
        tied_peer: int | None = None,
        expert_state_mesh: DeviceMesh | None = None,
        parts: list[int] | None = None,
        reduce_dtype: torch.dtype = torch.float32,
        overlap_grad_reduce: bool = True,
        zero2_accumulate_locally: bool = False,
    ):
        self.zero_stage = zero_stage
        self.state_mesh, self.expert_state_mesh = state_mesh, expert_state_mesh
        self.dp_group, self.tp_group, self.pp_group = dp_group, tp_group, pp_group
        if expert_state_mesh is not None:
            self.edp_group, self.ep_group = expert_state_mesh["edp"].get_group(), expert_state_mesh["ep"].get_group()
        self.max_norm = max_norm
        self.bucket_bytes = bucket_bytes
        self.tied, self.tied_peer = tied, tied_peer
        self.entries = [self._entry(name, param) for name, param in named_params]
        self.reduce_dtype = reduce_dtype
        # ZeRO-3: FSDP2 reduces the gradients of the parameters it shards; no buckets, no hooks.
        self.buckets = None if zero_stage == 3 else GradBuckets(
            self.entries, self._domains(), parts or [0] * len(self.entries), zero_stage=zero_stage,
            accumulate_in_fp32=accumulate_in_fp32, reduce_dtype=reduce_dtype, bucket_bytes=bucket_bytes,
            overlap=overlap_grad_reduce, accumulate_locally=zero2_accumulate_locally,
        )
        matrices = [e.master for e in self.entries if e.local.ndim >= 2]
        vectors = [e.master for e in self.entries if e.local.ndim < 2]
        # Norm gains are not decayed: pulling a gain towards 0 fights the normalisation it scales.
        groups = [{"params": matrices, "weight_decay": weight_decay}, {"params": vectors, "weight_decay": 0.0}]
        self.inner = build_inner([g for g in groups if g["params"]])

    def _entry(self, name: str, param: nn.Parameter) -> _Entry:
        with torch.no_grad():
            local = param.to_local() if isinstance(param, DTensor) else param.data
        sharded = {p.dim for p in param.placements if isinstance(p, Shard)} if isinstance(param, DTensor) else set()
        expert = isinstance(param, DTensor) and param.device_mesh.mesh_dim_names == ("ep",)
        dim = next((d for d in range(local.ndim) if d not in sharded), 0)
        shard = local
        if SHARDS_STATE[self.zero_stage]:
            group = self.edp_group if expert else self.dp_group
            shard = rank_chunk(local, dim, dist.get_world_size(group), dist.get_rank(group))
        master = shard.detach() if local.dtype == torch.float32 else shard.detach().float().clone()
        return _Entry(name, param, local, bool(sharded) and not expert, dim, master, expert=expert)

    def _domains(self) -> list[tuple[list[int], dist.ProcessGroup]]:
        """(entry indices, the group their gradients are reduced over): the dense parameters over dp, the
        expert-parallel experts over edp."""
        dense = [i for i, e in enumerate(self.entries) if not e.expert]
        experts = [i for i, e in enumerate(self.entries) if e.expert]
        domains = [(dense, self.dp_group)]
        if experts:
            domains.append((experts, self.edp_group))
        return domains

    def collect_gradients(self) -> list[torch.Tensor]:
        """Every parameter's accumulated local gradient in fp32 before the DP reduction (zeros for one that got
        none), for tests: valid while no bucket was reduced (dp 1, or backward not run by `forward_backward`).

        A gradient still in `.grad` (one added without running the post-accumulate hook) is folded in here; the
        pipeline stages run that hook after zero-bubble weight backward (`pipeline.Stage`).
        """
        return self.buckets.local_gradients()

    def step(self) -> torch.Tensor:
        """`reduce_gradients()` then `apply()`, unconditionally; returns the global norm before clipping."""
        norm = self.reduce_gradients()
        self.apply()
        return norm

    def reduce_gradients(self) -> torch.Tensor:
        """Finalises this step's gradients (the rest of the DP reduction, TP partial sums, tied copies, clipping)
        and returns their global norm before clipping, without a host sync.

        Separate from `apply()` so that the caller can look at the norm (and the loss) first and
        `discard()` a step whose numbers are not finite.
        """
        shards = [g.float() for g in self.buckets.finish()]
        all_reduce_tensors([g for e, g in zip(self.entries, shards) if e.tp_partial], self.tp_group, self.bucket_bytes)
        if self.tied and self.tied_peer is not None:
            _sync_tied_shards({e.name: g for e, g in zip(self.entries, shards) if e.name in self.tied}, self.tied,
                              self.tied_peer, self.pp_group)
        return self._finalise(shards, sharded_over_dp=SHARDS_STATE[self.zero_stage])

    def _finalise(self, shards: list[torch.Tensor], *, sharded_over_dp: bool) -> torch.Tensor:
        """Takes the global norm of the DP-reduced gradients (`shards`, one per entry), clips them, makes them the
        masters' gradients and returns the norm before clipping. `sharded_over_dp`: each dp rank holds another
        chunk of every gradient, so the squares are summed over dp too."""
        # A weight tied across pipeline stages has two entries with equal gradients: count it once.
        second_copy = self.tied[1] if self.tied and self.tied_peer is not None else None
        counted = [i for i, e in enumerate(self.entries) if e.name != second_copy and not e.expert]
        experts = [shards[i] for i, e in enumerate(self.entries) if e.expert]
        norm = global_grad_norm(
            [shards[i] for i in counted],
            [self.entries[i].tp_sharded for i in counted],
            tp_group=self.tp_group,
            pp_group=self.pp_group,
            dp_group=self.dp_group if sharded_over_dp else None,
            extra_squares=self._expert_squares(experts, sharded_over_dp) if experts else None,
        )
        if self.max_norm > 0:
            clip_gradients_(shards, self.max_norm, norm)
        self._set_master_grads(shards)
        return norm

    def _set_master_grads(self, shards: list[torch.Tensor]) -> None:
        """Makes the finalised `shards` the gradients the inner optimizer steps on."""
        for entry, shard in zip(self.entries, shards):
            entry.master.grad = shard

    def _expert_squares(self, shards: list[torch.Tensor], sharded_over_dp: bool) -> torch.Tensor:
        """The experts' squared gradient norm: each ep rank holds other experts, each edp rank (when sharded)
        another chunk of them."""
        groups = [self.ep_group, self.edp_group] if sharded_over_dp else [self.ep_group]
        return sum_of_squares(shards, groups)

    @property
    def applies_conditionally(self) -> bool:
        """Whether `apply(skip=...)` can leave the step undone on the device: torch's fused implementations take a
        `found_inf` flag and skip the update (step counts included) where it is 1, without a host sync."""
        return bool(self.inner.defaults.get("fused"))

    def apply(self, skip: torch.Tensor | None = None) -> None:
        """Steps the inner optimizer on the gradients `reduce_gradients()` finalised and writes the new parameters.

        `skip` (a one-element float tensor on the device, see `applies_conditionally`): where it is 1, parameters
        and optimizer state stay bitwise as they were, as after `discard()`.
        """
        self._step_inner(skip)
        self._write_parameters()
        self._zero_grads()

    def _step_inner(self, skip: torch.Tensor | None) -> None:
        if skip is None:
            self.inner.step()
            return
        if not self.applies_conditionally:
            raise ValueError(f"{type(self.inner).__name__} without fused=True cannot skip a step on the device")
        self.inner.found_inf = skip  # read by torch's fused step, as GradScaler sets it
        try:
            self.inner.step()
        finally:
            del self.inner.found_inf

    def discard(self) -> None:
        """Drops the finalised gradients: parameters and optimizer state (step counts included) stay
        bitwise as they were."""
        self._zero_grads()

    @torch.no_grad()
    def _write_parameters(self) -> None:
        if SHARDS_STATE[self.zero_stage]:
            # One all-gather per gradient bucket: its layout is that of the masters' chunks too.
            for bucket in self.buckets.buckets:
                entries = [self.entries[i] for i in bucket.members]
                all_gather_into(bucket.layout, [e.master for e in entries], [e.local for e in entries], bucket.group)
            return
        owned = [entry for entry in self.entries if entry.owns_master]
        if owned:  # bf16 parameters: their fp32 masters written back in one foreach copy
            torch._foreach_copy_([entry.local for entry in owned], [entry.master for entry in owned])

    def _zero_grads(self) -> None:
        for entry in self.entries:
            entry.master.grad = None
        self.buckets.zero_()

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """The optimizer state by parameter name, as the inner optimizer keys it (AdamW: "step", "exp_avg",
        "exp_avg_sq"); tensors shaped like the master are DTensors on the (dp, tp) mesh that share storage with
        the live state, so torch.distributed.checkpoint saves it and loads (and reshards) into it in place;
        scalars ("step") are kept as they are, the same on every rank.

        Before the first step the state is created as the first step would (`_initialise_state`), so a
        checkpoint has its keys and a resumed job has tensors to load into.
        "master" is present for low-precision parameters only (an fp32 parameter is its own master). A weight
        tied within this rank's model appears under both of its names (see `aliases`), so that a layout whose
        pipeline stages hold one copy each finds its copy's state under its own name.
        """
        if not self.inner.state:
            self._initialise_state()
        state = {}
        for entry in self.entries:
            state[entry.name] = {
                key: self._state_value(entry, key, value)
                for key, value in self.inner.state[entry.master].items()
                if value is not None
            }
            if entry.owns_master:
                state[entry.name]["master"] = self._as_dtensor(entry, entry.master)
        for alias, name in self.aliases.items():
            state[alias] = state[name]
        return state

    @property
    def aliases(self) -> dict[str, str]:
        """{second tied name: first} when one Parameter serves both names on this rank (no pipeline split
        between them): its state is that of the first name's entry."""
        names = {entry.name for entry in self.entries}
        if self.tied is None or self.tied[0] not in names or self.tied[1] in names:
            return {}
        return {self.tied[1]: self.tied[0]}

    def masters(self) -> dict[str, DTensor]:
        """Every parameter's fp32 value by name, as a DTensor on the state mesh sharing storage with the live
        state: the master of a low-precision parameter, a view of the parameter itself when it is fp32. A
        checkpoint loads the weights into these, then `parameters_from_masters()` writes the parameters, so a
        dtype change between save and load never goes through a rounded copy."""
        return {entry.name: self._as_dtensor(entry, entry.master) for entry in self.entries}

    @torch.no_grad()
    def parameters_from_masters(self) -> None:
        """Writes the masters into the parameters (after loading them)."""
        self._write_parameters()

    @torch.no_grad()
    def _initialise_state(self) -> None:
        """Creates the inner optimizer's state before its first step, as that step would: one step on zero
        gradients with the learning rate and weight decay at 0 (as `torch.distributed.checkpoint.state_dict`
        does), which leaves the masters bitwise as they were, then the step counts back at 0.

        For the registered optimizers a zero gradient leaves each state tensor at its initial value (AdamW's
        moments 0, Adagrad's sum its initial accumulator, SGD's momentum buffer 0, which equals the first
        gradient it would have copied once multiplied by momentum and added to), so the first real step
        is the same as without this.
        """
        masters = [e.master for e in self.entries]
        grads = [m.grad for m in masters]
        for master in masters:
            master.grad = torch.zeros_like(master)
        settings = [(group["lr"], group["weight_decay"]) for group in self.inner.param_groups]
        for group in self.inner.param_groups:
            group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
            group["weight_decay"] = 0.0
        self.inner.step()
        for group, (lr, weight_decay) in zip(self.inner.param_groups, settings):
            group["lr"], group["weight_decay"] = lr, weight_decay
        for master, grad in zip(masters, grads):
            master.grad = grad
            step = self.inner.state[master].get("step")
            if isinstance(step, torch.Tensor):
                step.zero_()
            elif step is not None:
                self.inner.state[master]["step"] = 0

    def _state_value(self, entry: _Entry, key: str, value: object) -> object:
        """One state value for the checkpoint: a DTensor for a tensor shaped like the master, else as it is."""
        if not isinstance(value, torch.Tensor) or value.ndim == 0:
            return value
        if value.shape != entry.master.shape:
            raise ConfigError(
                f"The optimizer state '{key}' of '{entry.name}' has the shape {tuple(value.shape)}, not that of its "
                f"master {tuple(entry.master.shape)}: ZeRO sharding and checkpoints need per-parameter state shaped "
                "like the parameter. Choose another optimizer.name."
            )
        return self._as_dtensor(entry, value)

    def _as_dtensor(self, entry: _Entry, local: torch.Tensor) -> DTensor:
        """`local` (this rank's shard of a tensor shaped like the parameter) as a DTensor on the state mesh:
        (dp, tp) for dense parameters, (edp, ep) for experts.

        When ZeRO-1 shards the dim the inner (tp or ep) placement already shards (a 1-D column-parallel
        bias), the data is cut inner-first: each rank's chunk of its TP-local tensor. DTensor reads
        [Shard(d), Shard(d)] outer-first, so that order is declared with `_StridedShard`, as FSDP2 + TP does.
        """
        mesh = self.expert_state_mesh if entry.expert else self.state_mesh
        inner = entry.param.placements[0] if isinstance(entry.param, DTensor) else Replicate()
        dp_placement: Placement = Replicate()
        if SHARDS_STATE[self.zero_stage]:
            inner_shards = mesh.size(1) if isinstance(inner, Shard) and inner.dim == entry.dim else 1
            dp_placement = _StridedShard(entry.dim, split_factor=inner_shards) if inner_shards > 1 else Shard(entry.dim)
        shape = entry.param.shape
        if isinstance(dp_placement, _StridedShard) and shape[entry.dim] % (mesh.size(0) * mesh.size(1)):
            # DTensor cuts uneven strided shards unlike torch.chunk does here: a reshard would move values.
            raise ConfigError(
                f"The ZeRO-1 optimizer state of '{entry.name}' cannot be checkpointed: its size along dim "
                f"{entry.dim} ({shape[entry.dim]}), which tensor parallelism shards, is not divisible by "
                f"{mesh.mesh_dim_names[0]} x {mesh.mesh_dim_names[1]} = {mesh.size(0) * mesh.size(1)}. Use "
                "optimizer.zero_stage = 0, or a data-parallel degree that divides it."
            )
        return DTensor.from_local(
            local, mesh, [dp_placement, inner], run_check=False, shape=shape,
            stride=torch.empty(shape, device="meta").stride(),
        )

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank: the inner optimizer's tensors (AdamW: its moments) plus master
        copies of low-precision weights."""
        moments = sum(v.nbytes for s in self.inner.state.values() for v in s.values() if isinstance(v, torch.Tensor))
        return moments + sum(e.master.nbytes for e in self.entries if e.owns_master)

    def param_bytes(self) -> int:
        """Bytes of this rank's parameter storage: the local (TP/EP-sharded) tensors of the model's parameters,
        a Parameter shared by two names once; fp32 masters of low-precision parameters are `state_bytes`'."""
        params = {id(e.param): e.local for e in self.entries}
        return sum(local.nbytes for local in params.values())

    def grad_bytes(self) -> int:
        """Bytes of this rank's persistent gradient storage: the bucket buffers (full local gradients under
        stages 0 and 1, this rank's DP shard under stage 2; transient stage-2 buffers not counted)."""
        return self.buckets.grad_bytes()


def _sync_tied_shards(
    shards: dict[str, torch.Tensor], tied: tuple[str, str], peer: int, group: dist.ProcessGroup
) -> None:
    """`sync_tied_gradients` on the DP shards of the tied copies (views, maybe strided: sent contiguous)."""
    dense = {name: shard.contiguous() for name, shard in shards.items()}
    sync_tied_gradients(dense, tied, peer, group)
    for name, shard in shards.items():
        if dense[name] is not shard:
            shard.copy_(dense[name])
