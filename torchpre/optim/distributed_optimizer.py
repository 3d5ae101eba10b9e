"""A torch optimizer on fp32 master weights of this rank's data-parallel shards, under every ZeRO stage.

The gradients it steps on come finished from a gradient reduction (`torchpre.parallel.grad_reduction`: the DP sum,
TP partial sums and tied copies, on this rank's shards). This class takes their global norm, clips them, steps
the inner optimizer (any `torch.optim` class, see `torchpre.optim.registry`) on the masters and hands the new
values back to the reduction, which writes them into the parameters (a copy, or one all-gather per bucket).

What each rank keeps follows the data-parallel strategy (`DataParallel`): with replicated state the masters are
whole (a view of each fp32 parameter, or an fp32 copy of a bf16 one); with sharded state they are the rank's
`torch.chunk` of every parameter along its first dimension that tensor parallelism does not shard (DTensor's Shard
semantics), so the state is a plain 2-D-mesh DTensor (Shard over dp, the TP placement over tp) that checkpoints can
reshard; a tensor whose only dimension TP shards is cut along it again, within its TP-local part (`_StridedShard`).
Under ZeRO-3 the masters are FSDP's sharded fp32 parameters themselves, and the state has FSDP's placements.
The inner optimizer's per-parameter state tensors are shaped like the master, so they are sharded and checkpointed
exactly like it.

Experts sharded by expert parallelism (DTensors on the 1-D `ep` mesh, Shard(0) over experts) form a second domain:
each expert lives on one rank of every ep group, so its gradient is reduced over the expert-data-parallel group
`edp` instead of all of DP, its shard is taken over edp, and its state is a DTensor on the 2-D (edp, ep) mesh.
Memory per parameter (bytes: parameter + gradient + state), for AdamW's two moments: fp32 16, ZeRO-1 8 + 8/dp,
ZeRO-2 4 + 12/dp, ZeRO-3 16/dp; bf16 parameters with fp32 gradients and masters 18, ZeRO-1 6 + 12/dp,
ZeRO-2 2 + 16/dp.
"""

from collections.abc import Callable
from functools import partial

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from torchpre.errors import ConfigError
from torchpre.optim.param_scales import GroupKey, ParamScales
from torchpre.parallel.data_parallel import ShardedParameter
from torchpre.parallel.grad_clip import clip_gradients_, global_grad_norm, sum_of_squares
from torchpre.parallel.grad_reduction import GradReduction


class DistributedOptimizer:
    """The optimizer of a (possibly TP-sharded, pipelined, FSDP-sharded) model over data parallelism.

    `step()` finishes the gradients (`reduce_gradients()`), steps the inner optimizer and writes the parameters; it
    returns the global gradient norm before clipping. `reduce_gradients()`, then `apply()` or `discard()`, is the
    same step for a caller that first checks the norm; `clip_(grads)` is its second half, for a caller that ran the
    reduction itself. `inner` is the torch optimizer over the masters (for the LR scheduler), built by
    `build_inner(param_groups)`: matrices decay by `weight_decay`, vectors (norm gains, biases) do not.
    `state_mesh` is the 2-D (dp, tp) mesh the state is laid out on in `state_dict()` (ZeRO 0-2);
    `expert_state_mesh`, the 2-D (edp, ep) mesh of expert-parallel experts' state (None without experts).
    Each param group also holds its parameters' "names"; `whole_matrices` adds their "layouts" (the DTensor each
    master is a shard of) for an inner optimizer whose update needs whole matrices (`torchpre.optim.muon`).
    `scales` (a parametrization's per-parameter factors, µP) splits the groups further, each with its factors on
    the lr, weight decay and eps: every group of the whole model, in the same order on every rank.
    """

    def __init__(
        self,
        reduction: GradReduction,
        *,
        build_inner: Callable[[list[dict]], torch.optim.Optimizer],
        weight_decay: float,
        max_norm: float,
        state_mesh: DeviceMesh | None = None,
        expert_state_mesh: DeviceMesh | None = None,
        whole_matrices: bool = False,
        scales: ParamScales | None = None,
    ):
        self.reduction = reduction
        self.params: list[ShardedParameter] = reduction.params
        self.data_parallel, self.groups = reduction.strategy, reduction.groups
        self.state_mesh, self.expert_state_mesh = state_mesh, expert_state_mesh
        self.max_norm = max_norm
        self.masters = [self._master(p) for p in self.params]
        if scales is not None:
            self.inner = build_inner(self._scaled_groups(weight_decay, whole_matrices, scales))
            _apply_factors(self.inner)
            return
        # Norm gains are not decayed: pulling a gain towards 0 fights the normalisation it scales.
        groups = [self._group(weight_decay, whole_matrices, lambda p: p.local.ndim >= 2),
                  self._group(0.0, whole_matrices, lambda p: p.local.ndim < 2)]  # fmt: skip
        self.inner = build_inner([g for g in groups if g["params"]])

    def _scaled_groups(self, weight_decay: float, layouts: bool, scales: ParamScales) -> list[dict]:
        """One group per key of `scales` (empty where this rank holds none of its parameters), each parameter's key
        read off its global shape; matrices decay by `weight_decay` times their factor, vectors do not decay."""
        keys = {p.name: scales.key(p.name, p.param.shape) for p in self.params}
        known = scales.keys()
        stray = [(name, key) for name, key in keys.items() if key not in known]
        if stray:
            raise ValueError(f"the factors {stray[0][1]} of {stray[0][0]} are none of the model's {known}")
        groups = []
        for key in known:
            decays, lr, decay, eps = key
            group = self._group(weight_decay * decay if decays else 0.0, layouts, partial(_keyed, keys, key))
            groups.append(group | {"lr_factor": lr, "eps_factor": eps})
        return groups

    def _group(self, weight_decay: float, layouts: bool, member: Callable[[ShardedParameter], bool]) -> dict:
        """A param group of the inner optimizer: the masters of the parameters `member` selects and their names,
        and, for an optimizer that assembles whole matrices (`layouts`), the DTensor each master is a shard of."""
        chosen = [i for i, p in enumerate(self.params) if member(p)]
        group = {"params": [self.masters[i] for i in chosen], "weight_decay": weight_decay,
                 "names": [self.params[i].name for i in chosen]}  # fmt: skip
        if layouts:
            group["layouts"] = [self._as_dtensor(i, self.masters[i]) for i in chosen]
        return group

    def _master(self, param: ShardedParameter) -> torch.Tensor:
        """The fp32 tensor the inner optimizer steps: under ZeRO-3 the FSDP parameter itself (its gradient is the
        parameter's), else a view of the shard when the parameter is fp32, or an fp32 copy of it."""
        if self.data_parallel.shards_parameters:
            return param.param
        return param.shard.detach() if param.shard.dtype == torch.float32 else param.shard.detach().float().clone()

    @property
    def lr(self) -> float:
        """The schedule's learning rate now (a group's lr over its parametrization factor)."""
        group = self.inner.param_groups[0]
        return group["lr"] / group.get("lr_factor", 1.0)

    def owns_master(self, i: int) -> bool:
        """Whether the i-th master is a copy of its own (the parameter is not fp32). Decided by dtype, not by
        comparing storage pointers: those are 0 for every meta or fake tensor, where a dry run builds this."""
        return self.masters[i].dtype != self.params[i].local.dtype

    def step(self) -> torch.Tensor:
        """`reduce_gradients()` then `apply()`, unconditionally; returns the global norm before clipping."""
        norm = self.reduce_gradients()
        self.apply()
        return norm

    def reduce_gradients(self) -> torch.Tensor:
        """Finishes this step's gradients through the reduction and `clip_`s them; returns their global norm
        before clipping, without a host sync. Separate from `apply()` so that the caller can look at the norm
        (and the loss) first and `discard()` a step whose numbers are not finite."""
        return self.clip_(self.reduction.reduce())

    def clip_(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Takes the global norm of the finished gradients (`grads`, one per parameter, this rank's shards), clips
        them in place, makes them the masters' gradients and returns the norm before clipping."""
        sharded_over_dp = self.data_parallel.shards_optimizer_state
        counted = [i for i, p in enumerate(self.params) if p.name != self.groups.tied_copy and not p.expert]
        experts = [grads[i] for i, p in enumerate(self.params) if p.expert]
        norm = global_grad_norm(
            [grads[i] for i in counted],
            [self.params[i].tp_sharded for i in counted],
            tp_group=self.groups.tp,
            pp_group=self.groups.pp,
            dp_group=self.groups.dp if sharded_over_dp else None,
            extra_squares=self._expert_squares(experts, sharded_over_dp) if experts else None,
        )
        if self.max_norm > 0:
            clip_gradients_(grads, self.max_norm, norm)
        if not self.data_parallel.shards_parameters:  # under ZeRO-3 they are the parameters' own gradients already
            for master, grad in zip(self.masters, grads):
                master.grad = grad
        return norm

    def _expert_squares(self, grads: list[torch.Tensor], sharded_over_dp: bool) -> torch.Tensor:
        """The experts' squared gradient norm: each ep rank holds other experts, each edp rank (when sharded)
        another chunk of them."""
        groups = [self.groups.ep, self.groups.edp] if sharded_over_dp else [self.groups.ep]
        return sum_of_squares(grads, groups)

    @property
    def applies_conditionally(self) -> bool:
        """Whether `apply(skip=...)` can leave the step undone on the device: torch's fused implementations take a
        `found_inf` flag and skip the update (step counts included) where it is 1, without a host sync."""
        return bool(self.inner.defaults.get("fused"))

    def apply(self, skip: torch.Tensor | None = None) -> None:
        """Steps the inner optimizer on the gradients `clip_` took and writes the new parameters.

        `skip` (a one-element float tensor on the device, see `applies_conditionally`): where it is 1, parameters
        and optimizer state stay bitwise as they were, as after `discard()`.
        """
        self._step_inner(skip)
        self.reduction.sync_parameters(self.masters)
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
        """Drops the finished gradients: parameters and optimizer state (step counts included) stay
        bitwise as they were."""
        self._zero_grads()

    def _zero_grads(self) -> None:
        for master in self.masters:
            master.grad = None
        self.reduction.zero_()

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """The optimizer state by parameter name, as the inner optimizer keys it (AdamW: "step", "exp_avg",
        "exp_avg_sq"); tensors shaped like the master are DTensors on the state mesh that share storage with
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
        for i, (param, master) in enumerate(zip(self.params, self.masters)):
            state[param.name] = {
                key: self._state_value(i, key, value)
                for key, value in self.inner.state[master].items()
                if value is not None
            }
            if self.owns_master(i):
                state[param.name]["master"] = self._as_dtensor(i, master)
        for alias, name in self.aliases.items():
            state[alias] = state[name]
        return state

    def load_state_dict(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Nothing to copy: `torch.distributed.checkpoint` loads into the live tensors of `state_dict()` in place."""

    def load_targets(self, saved: set[str]) -> dict[str, dict[str, torch.Tensor]]:
        """What a checkpoint load fills, given the checkpoint's flattened keys (`saved`, "optimizer.NAME.KEY"):
        `state_dict()` without the second names of tied weights (their state is the first's), and every master the
        checkpoint holds ("master", written by a low-precision run), into this rank's fp32 masters. `model_targets`
        then loads the other weights into the masters."""
        state = self.state_dict()
        for alias in self.aliases:
            state.pop(alias, None)
        for i, (param, master) in enumerate(zip(self.params, self.masters)):
            if f"optimizer.{param.name}.master" in saved:
                state[param.name]["master"] = self._as_dtensor(i, master)
            else:
                state[param.name].pop("master", None)
        return state

    def model_targets(self, model_state: dict[str, torch.Tensor], saved: set[str]) -> dict[str, torch.Tensor]:
        """Where a checkpoint's model weights load (`model_state`: the model parts' state dict): every parameter
        through its fp32 master, from the saved master when the checkpoint has one (a low-precision run, loaded by
        `load_targets`), else from the saved parameter. So bf16 -> fp32 resumes from the saved fp32 masters and
        fp32 -> bf16 takes the saved fp32 parameters as masters, instead of either going through a bf16-rounded
        copy. The second names of tied weights are left out (one Parameter, loaded under the first name)."""
        targets = {name: value for name, value in model_state.items() if name not in self.aliases}
        for name, master in self.masters_by_name().items():
            if f"optimizer.{name}.master" in saved:
                targets.pop(name, None)
            else:
                targets[name] = master
        return targets

    @property
    def aliases(self) -> dict[str, str]:
        """{second tied name: first} when one Parameter serves both names on this rank (no pipeline split
        between them): its state is that of the first name's entry."""
        tied = self.groups.tied
        names = {p.name for p in self.params}
        if tied is None or tied[0] not in names or tied[1] in names:
            return {}
        return {tied[1]: tied[0]}

    def masters_by_name(self) -> dict[str, DTensor]:
        """Every parameter's fp32 value by name, as a DTensor on the state mesh sharing storage with the live
        state: the master of a low-precision parameter, a view of the parameter itself when it is fp32. A
        checkpoint loads the weights into these, then `parameters_from_masters()` writes the parameters, so a
        dtype change between save and load never goes through a rounded copy."""
        return {p.name: self._as_dtensor(i, m) for i, (p, m) in enumerate(zip(self.params, self.masters))}

    @torch.no_grad()
    def parameters_from_masters(self) -> None:
        """Writes the masters into the parameters (after loading them)."""
        self.reduction.sync_parameters(self.masters)

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
        grads = [m.grad for m in self.masters]
        for master in self.masters:
            master.grad = torch.zeros_like(master)
        settings = [(group["lr"], group["weight_decay"]) for group in self.inner.param_groups]
        for group in self.inner.param_groups:
            group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
            group["weight_decay"] = 0.0
        # An optimizer whose step is a collective (Muon assembles matrices) creates its state without one.
        getattr(self.inner, "initialise_state", self.inner.step)()
        for group, (lr, weight_decay) in zip(self.inner.param_groups, settings):
            group["lr"], group["weight_decay"] = lr, weight_decay
        for master, grad in zip(self.masters, grads):
            master.grad = grad
            step = self.inner.state[master].get("step")
            if isinstance(step, torch.Tensor):
                step.zero_()
            elif step is not None:
                self.inner.state[master]["step"] = 0

    def _state_value(self, i: int, key: str, value: object) -> object:
        """One state value for the checkpoint: a DTensor for a tensor shaped like the master, else as it is."""
        if not isinstance(value, torch.Tensor) or value.ndim == 0:
            return value
        if value.shape != self.masters[i].shape:
            raise ConfigError(
                f"The optimizer state '{key}' of '{self.params[i].name}' has the shape {tuple(value.shape)}, not that "
                f"of its master {tuple(self.masters[i].shape)}: ZeRO sharding and checkpoints need per-parameter "
                "state shaped like the parameter. Choose another optimizer.name."
            )
        return self._as_dtensor(i, value)

    def _as_dtensor(self, i: int, local: torch.Tensor) -> DTensor:
        """`local` (this rank's shard of a tensor shaped like the i-th parameter) as a DTensor on the state mesh:
        (dp, tp) for dense parameters, (edp, ep) for experts; under ZeRO-3 the state of an FSDP parameter is a
        DTensor with its placements already.

        When ZeRO shards the dim the inner (tp or ep) placement already shards (a 1-D column-parallel bias), the
        data is cut inner-first: each rank's chunk of its TP-local tensor. DTensor reads [Shard(d), Shard(d)]
        outer-first, so that order is declared with `_StridedShard`, as FSDP2 + TP does.
        """
        if isinstance(local, DTensor):
            return local
        param = self.params[i]
        mesh = self.expert_state_mesh if param.expert else self.state_mesh
        inner = param.param.placements[0] if isinstance(param.param, DTensor) else Replicate()
        dp_placement: Placement = Replicate()
        if self.data_parallel.shards_optimizer_state:
            inner_shards = mesh.size(1) if isinstance(inner, Shard) and inner.dim == param.dim else 1
            dp_placement = _StridedShard(param.dim, split_factor=inner_shards) if inner_shards > 1 else Shard(param.dim)
        shape = param.param.shape
        if isinstance(dp_placement, _StridedShard) and shape[param.dim] % (mesh.size(0) * mesh.size(1)):
            # DTensor cuts uneven strided shards unlike torch.chunk does here: a reshard would move values.
            raise ConfigError(
                f"The ZeRO-1 optimizer state of '{param.name}' cannot be checkpointed: its size along dim "
                f"{param.dim} ({shape[param.dim]}), which tensor parallelism shards, is not divisible by "
                f"{mesh.mesh_dim_names[0]} x {mesh.mesh_dim_names[1]} = {mesh.size(0) * mesh.size(1)}. Use "
                "optimizer.zero_stage = 0, or a data-parallel degree that divides it."
            )
        return DTensor.from_local(
            local, mesh, [dp_placement, inner], run_check=False, shape=shape,
            stride=torch.empty(shape, device="meta").stride(),
        )

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank: the inner optimizer's tensors (AdamW: its moments and step
        counts; local shards of DTensors) plus master copies of low-precision weights."""
        moments = sum(
            _local(v).nbytes for s in self.inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)
        )
        return moments + sum(m.nbytes for i, m in enumerate(self.masters) if self.owns_master(i))

    @property
    def assembles_matrices(self) -> bool:
        """Whether each step assembles whole matrices from their shards (a matrix-aware optimizer, Muon)."""
        return hasattr(self.inner, "sent_bytes")

    def sent_bytes(self) -> int:
        """Bytes this rank sent in the last step to assemble whole matrices and return their updates' shards."""
        return getattr(self.inner, "sent_bytes", 0)

    def param_bytes(self) -> int:
        """Bytes of this rank's parameter storage: the local (TP/EP/FSDP-sharded) tensors of the model's
        parameters, a Parameter shared by two names once; fp32 masters of low-precision parameters are
        `state_bytes`'. Gathered compute copies (FSDP's) are transient."""
        params = {id(p.param): _local(p.local) for p in self.params}
        return sum(local.nbytes for local in params.values())

    def grad_bytes(self) -> int:
        """Bytes of this rank's persistent gradient storage (the reduction's)."""
        return self.reduction.grad_bytes()


def _keyed(keys: dict[str, GroupKey], key: GroupKey, param: ShardedParameter) -> bool:
    return keys[param.name] == key


def _apply_factors(inner: torch.optim.Optimizer) -> None:
    """Each group's lr (and eps, for an optimizer that has one) times the group's parametrization factors, before
    the LR schedule records the groups' lrs as its bases."""
    for group in inner.param_groups:
        group["lr"] = group["lr"] * group["lr_factor"]
        if "eps" in group:
            group["eps"] = group["eps"] * group["eps_factor"]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
