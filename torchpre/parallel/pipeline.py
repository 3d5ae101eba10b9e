"""Pipeline parallelism: split a model into stages and drive them with a torch.distributed.pipelining schedule.

The split is expressed as module names per stage (e.g. `["tok_embeddings", "layers.0", "layers.1"]`), so
it works for any model whose forward skips the parts a stage does not hold (set to None, None in a
ModuleList, or removed from a ModuleDict). Stages are placed loop-style (rank r holds stages r, r + pp, ...)
or, for the V schedules, as a V (rank r holds stages r and 2 pp - 1 - r).
"""

import contextlib
import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage, schedules
from torch.distributed.pipelining._backward import stage_backward_weight

from torchpre.distributed.clock import SpanClock
from torchpre.errors import ConfigError, resolve_step
from torchpre.step_rules.schedules import PipelineSchedule, get_schedule, names_where

EMBEDDING_LAYERS_KEY = "parallelism.pipeline_parallel_embedding_layers"
OUTPUT_LAYERS_KEY = "parallelism.pipeline_parallel_output_layers"


def schedule_class(schedule: PipelineSchedule) -> type:
    """The torch schedule class of `schedule`'s row."""
    return getattr(schedules, schedule.torch_class)


@dataclass(frozen=True)
class PipelinePlan:
    """Everything about the pipeline that follows from the config, checked before any work; `schedule` is its row
    of the schedules' table, resolved once from the config's name. `microbatch_size` is the sequences per pipeline
    microbatch (parallelism.pipeline_parallel_microbatch_size); 0 for a plan built with a number of microbatches
    only, which every training step is cut into."""

    schedule: PipelineSchedule
    pp: int
    stages_per_rank: int
    n_microbatches: int
    stage_modules: list[list[str]]
    microbatch_size: int = 0

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @classmethod
    @resolve_step
    def from_config(
        cls, parallelism, stage_modules: Callable[[int], list[list[str]]], sequences_per_step: int
    ) -> "PipelinePlan":
        """`parallelism` is the config section; `stage_modules(num_stages)` is the model's split;
        `sequences_per_step` is what one DP rank processes per optimizer step."""
        schedule = get_schedule(parallelism.pipeline_parallel_schedule)
        pp = parallelism.pipeline_parallel_degree
        counts = parallelism.pipeline_parallel_embedding_layers, parallelism.pipeline_parallel_output_layers
        if parallelism.pipeline_parallel_split_points and any(counts):
            raise ConfigError(
                f"parallelism.pipeline_parallel_split_points names each stage's first layer, so {EMBEDDING_LAYERS_KEY} "
                f"= {counts[0]} and {OUTPUT_LAYERS_KEY} = {counts[1]} cannot move them: set both to 0, or clear the "
                "split points to split evenly."
            )
        per_rank = checked_stages_per_rank(schedule, parallelism.pipeline_parallel_virtual_stages)
        microbatch_size = parallelism.pipeline_parallel_microbatch_size
        if microbatch_size < 1 or sequences_per_step % microbatch_size:
            raise ConfigError(
                f"parallelism.pipeline_parallel_microbatch_size = {microbatch_size} must be at least 1 and divide "
                f"the {sequences_per_step} sequences each data-parallel rank processes per step "
                "(training.local_batch_size x gradient-accumulation steps)."
            )
        n_microbatches = sequences_per_step // microbatch_size
        check_microbatches(schedule, n_microbatches, pp, pp * per_rank)
        return cls(schedule, pp, per_rank, n_microbatches, stage_modules(pp * per_rank), microbatch_size)

    @classmethod
    def build(cls, stage_modules: list[list[str]], pp: int, schedule: str = "1F1B", n_microbatches: int = 1):
        """A plan from module names per stage (e.g. `pipeline_stages(model, ...)`): len(stage_modules) / pp
        stages per rank, checked like a config."""
        row = get_schedule(schedule)
        if len(stage_modules) % pp:
            raise ConfigError(f"{len(stage_modules)} pipeline stages do not split evenly over {pp} ranks.")
        per_rank = len(stage_modules) // pp
        if per_rank != row.stages_per_rank(per_rank):
            raise ConfigError(f"The '{row.name}' schedule cannot hold {per_rank} stages per rank.")
        check_microbatches(row, n_microbatches, pp, len(stage_modules))
        return cls(row, pp, per_rank, n_microbatches, [list(names) for names in stage_modules])

    def microbatches_in(self, sequences: int) -> int:
        """The microbatches a training step of `sequences` (on one data-parallel rank) runs as: as many sequences
        each whatever the step's batch (a global-batch ramp's smaller steps run fewer), or the plan's number."""
        return sequences // self.microbatch_size if self.microbatch_size else self.n_microbatches

    def stage_ids(self, pp_rank: int) -> list[int]:
        return self.schedule.stage_ids(pp_rank, self.pp, self.stages_per_rank)

    def stage_rank(self, stage: int) -> int:
        return self.schedule.stage_rank(stage, self.pp)

    def describe(self) -> str:
        stages = "; ".join(f"{i}: {', '.join(names)}" for i, names in enumerate(self.stage_modules))
        return (
            f"{self.schedule.name}, {self.num_stages} stages ({self.stages_per_rank} per rank), "
            f"{self.n_microbatches} microbatches per step; stages {stages}"
        )


def checked_stages_per_rank(schedule: PipelineSchedule, virtual_stages: int) -> int:
    """The stages each rank holds (`PipelineSchedule.stages_per_rank`); a ConfigError if the schedule cannot hold
    parallelism.pipeline_parallel_virtual_stages = `virtual_stages`."""
    key = "parallelism.pipeline_parallel_virtual_stages"
    if not schedule.multi_stage and virtual_stages > 1:
        raise ConfigError(
            f"{key} = {virtual_stages}, but '{schedule.name}' runs one stage per rank. Use one of "
            f"{', '.join(names_where(multi_stage=True, placement='loop'))} for virtual stages, or set it to 1."
        )
    if schedule.multi_stage and schedule.placement == "v" and virtual_stages not in (1, 2):
        raise ConfigError(f"{key} = {virtual_stages}, but '{schedule.name}' places exactly 2 stages per rank (a V).")
    return schedule.stages_per_rank(virtual_stages)


def check_microbatches(schedule: PipelineSchedule, n_microbatches: int, pp: int, num_stages: int) -> None:
    """Rejects microbatch counts `schedule` cannot run, before any work."""
    fix = (
        "Raise training.local_batch_size (or training.global_batch_size) or lower "
        "parallelism.pipeline_parallel_microbatch_size."
    )
    if schedule.microbatches_per_stage and n_microbatches < num_stages:
        raise ConfigError(
            f"The '{schedule.name}' schedule needs at least as many microbatches as stages ({num_stages}), "
            f"but a step has {n_microbatches}. {fix}"
        )
    if schedule.rounds:
        rounds = max(1, n_microbatches // pp)
        if n_microbatches % rounds:
            raise ConfigError(
                f"The '{schedule.name}' schedule runs microbatches in rounds of the pipeline degree ({pp}); "
                f"{n_microbatches} microbatches per step do not split into {rounds} equal rounds. "
                f"Use a multiple of {pp}. {fix}"
            )


def split_layers(
    layer_names: Sequence[str],
    num_stages: int,
    split_points: Sequence[str] = (),
    *,
    embedding_layers: int = 0,
    output_layers: int = 0,
) -> list[list[str]]:
    """Assigns consecutive layers to stages: at `split_points`, the names of the first layer of each stage after
    the first, or evenly, earlier stages getting the extra layers. An even split may count the embedding as
    `embedding_layers` layers of the first stage and the output (final norm, output layer, loss) as `output_layers`
    of the last (torchtitan's input/output weights, Megatron-Core's account_for_embedding/loss_in_pipeline_split):
    those stages hold fewer blocks, down to none (the embedding or the output alone). A job's config reaches here
    checked (`PipelinePlan.from_config`, the keys' bounds); a caller passing both split points and counts, or a
    negative count, gets a ValueError."""
    if embedding_layers < 0 or output_layers < 0 or (split_points and (embedding_layers or output_layers)):
        raise ValueError(
            f"split_layers: embedding_layers = {embedding_layers} and output_layers = {output_layers} must be 0 or "
            "more, and 0 with split points (they name every stage's first layer)."
        )
    if split_points:
        return _split_at(layer_names, num_stages, split_points)
    sizes = _even_sizes(len(layer_names) + embedding_layers + output_layers, num_stages)
    sizes[0] -= embedding_layers
    sizes[-1] -= output_layers
    counted = bool(embedding_layers or output_layers)
    if min(sizes) < (0 if counted else 1) or min(sizes[1:-1], default=1) < 1:
        raise ConfigError(_too_few_layers(len(layer_names), sizes, embedding_layers, output_layers))
    starts = [sum(sizes[:stage]) for stage in range(num_stages + 1)]
    return [list(layer_names[a:b]) for a, b in zip(starts, starts[1:])]


def _even_sizes(units: int, num_stages: int) -> list[int]:
    """`units` over `num_stages` as evenly as possible, the earlier stages taking the extra ones."""
    base, extra = divmod(units, num_stages)
    return [base + (1 if stage < extra else 0) for stage in range(num_stages)]


def _too_few_layers(layers: int, sizes: list[int], embedding_layers: int, output_layers: int) -> str:
    if not (embedding_layers or output_layers):
        return (
            f"The model has {layers} layers, fewer than the {len(sizes)} pipeline stages "
            "(pipeline_parallel_degree x stages per rank). Lower the pipeline degree or the virtual stages."
        )
    return (
        f"The model's {layers} layers, with the embedding counted as {embedding_layers} ({EMBEDDING_LAYERS_KEY}) and "
        f"the output as {output_layers} ({OUTPUT_LAYERS_KEY}), split evenly over {len(sizes)} pipeline stages give "
        f"{sizes} blocks: only the first stage (the embedding) and the last (the output) may hold none. Lower those "
        "counts, the pipeline degree or the virtual stages."
    )


def _split_at(layer_names: Sequence[str], num_stages: int, split_points: Sequence[str]) -> list[list[str]]:
    if len(split_points) != num_stages - 1:
        raise ConfigError(
            f"parallelism.pipeline_parallel_split_points has {len(split_points)} entries; "
            f"{num_stages} stages need {num_stages - 1}."
        )
    unknown = [name for name in split_points if name not in layer_names]
    if unknown:
        raise ConfigError(
            f"parallelism.pipeline_parallel_split_points names '{unknown[0]}', which is not a layer. "
            f"Layers: {', '.join(layer_names)}."
        )
    starts = [0, *(layer_names.index(name) for name in split_points), len(layer_names)]
    if any(a >= b for a, b in zip(starts, starts[1:])):
        raise ConfigError(
            "parallelism.pipeline_parallel_split_points must name layers in increasing order, each stage non-empty."
        )
    return [list(layer_names[a:b]) for a, b in zip(starts, starts[1:])]


def prune_to(model: nn.Module, keep: Sequence[str]) -> nn.Module:
    """A copy of `model` holding only the submodules named in `keep` (dotted names at any depth, e.g.
    "tok_embeddings", "layers.3" or "model.layers.3") and the modules on their paths. The others become None,
    except that a container (ModuleDict, ModuleList) stays, emptied of the entries not kept: a ModuleDict drops
    their keys, a ModuleList holds None in their places, so every kept name is unchanged.

    Meant for a model on the meta device, so copying costs nothing.
    """
    stage = copy.deepcopy(model)
    _prune(stage, "", set(keep))
    return stage


def _prune(module: nn.Module, prefix: str, kept: set[str]) -> None:
    for name, child in list(module.named_children()):
        path = prefix + name
        if path in kept:
            continue
        if isinstance(child, (nn.ModuleDict, nn.ModuleList)) or any(k.startswith(f"{path}.") for k in kept):
            _prune(child, f"{path}.", kept)
        elif isinstance(module, nn.ModuleDict):
            del module[name]
        else:
            module.register_module(name, None)


class HookedPipelineStage(PipelineStage):
    """A `PipelineStage` whose weight-only backward (the zero-bubble schedules' W step) ends like an ordinary
    backward: it runs the post-accumulate-grad hooks of each parameter whose gradient it accumulated.

    torch computes those weight gradients with `autograd.grad` and adds them with `weight.grad += dw`, which
    fires no hook; the optimizer moves every gradient into its buckets from that hook (fp32 accumulation, the
    data-parallel reduction during backward), so without this these schedules would leave gradients behind.

    Its input-only backward hands on disjoint parameter groups (`disjoint_param_groups`) and its weight-only
    backward keeps the graph until every group ran (`weight_backward`): torch's own lose or double the gradient of
    a weight that enters a stage more than once through parameter-only branches (the multi-token prediction's
    embedding copy, looked up for every depth).

    Before each backward that produces weight gradients (full or weight-only, not input-only) it calls
    `backward_callback(part_index, last_backward)` (set by `ParallelModel.set_backward_callback`), so the
    optimizer knows which microbatch's backward is this stage's last in the step.

    While `clock` is set, its "compute" span times each forward, backward and weight backward of one microbatch:
    the busy time whose complement in a schedule step is the pipeline bubble (P2P waits stay outside).
    """

    def __init__(self, *args, part_index: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.part_index = part_index
        self.backward_callback: Callable[[int, bool], None] | None = None
        self.clock: SpanClock | None = None

    def _computing(self) -> contextlib.AbstractContextManager:
        return self.clock.span("compute") if self.clock is not None else contextlib.nullcontext()

    def forward_one_chunk(self, *args, **kwargs):
        with self._computing():
            return super().forward_one_chunk(*args, **kwargs)

    def backward_one_chunk(self, *args, **kwargs):
        with self._computing():
            return super().backward_one_chunk(*args, **kwargs)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if self.backward_callback is not None and backward_type in ("full", "weight"):
            self.backward_callback(self.part_index, last_backward)
        if backward_type == "weight":
            return weight_backward(self.submod, bwd_kwargs["param_groups"]), None
        grads, param_groups = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
        return grads, None if param_groups is None else disjoint_param_groups(param_groups)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        with self._computing():
            if isinstance(self.submod, FSDPModule):
                # ZeRO-3: FSDP accumulates the unsharded gradients itself and reduce-scatters them after the last
                # backward (`perform_reduce_grad`); the optimizer registers no hooks to run.
                super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
                return
            params = list(self.submod.parameters())
            before = [_grad_version(p) for p in params]
            super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
            for param, version in zip(params, before):
                if param.grad is not None and _grad_version(param) != version:
                    # torch keeps no public way to run these; `register_post_accumulate_grad_hook` fills this dict.
                    for hook in list((param._post_accumulate_grad_hooks or {}).values()):
                        hook(param)


def weight_backward(submod: nn.Module, param_groups: list[dict]) -> tuple[torch.Tensor | None, ...]:
    """A stage's weight-only backward (torch's `stage_backward_weight`) over `disjoint_param_groups`, keeping the
    graph until every group has run where torch frees it group by group. A group whose intermediates feed one
    another through the stage's input graph (the multi-token prediction's embedding copy enters every depth, and so
    every later depth through the earlier ones too) runs backward through the nodes between them, which other
    groups run as well; the gradients stay exact, since each intermediate's saved gradient replaces what arrives
    there. The graph goes with the microbatch's backward state, dropped right after: the peak memory stays the input
    backward's."""
    if isinstance(submod, FSDPModule):  # as torch's own weight step: FSDP reduces after the step's last backward
        submod.set_is_last_backward(False)
        submod.set_reshard_after_backward(False)
        submod.set_requires_gradient_sync(False)
    return stage_backward_weight(submod.parameters(), param_groups, retain_graph=True)


def disjoint_param_groups(param_groups: list[dict]) -> list[dict]:
    """The zero-bubble schedules' parameter groups (`stage_backward_input`'s: the parameters whose weight gradients
    flow back from the same saved intermediate gradients), merged until no parameter or intermediate is in two.

    torch 2.14 merges a parameter's group with a group it shares an intermediate with, but not transitively: with
    parameters A reaching the stage's input graph at {n1}, B at {n2} and C at {n1, n2} (one weight feeding two
    branches that only parameters feed before they meet the input's: DeepSeek-V3's multi-token prediction embedding
    copy, looked up once per depth, and each depth's embedding norm), it returns {A, C} and {A, B, C}. The weight
    backward then runs the shared branch once per group: an error once the first run freed its saved tensors, and
    A's and C's gradients counted twice where nothing was saved. Each merged group keeps the gradients its groups
    saved for each intermediate (every group hooked on a node saved the same ones)."""
    merged: list[dict] = []
    for group in param_groups:
        nodes = list(group.get("intermediates", ()))
        grads = dict(zip(nodes, group["grads"])) if "grads" in group else {}
        overlapping = [
            other for other in merged if other["params"] & group["params"] or other["saved"].keys() & set(nodes)
        ]
        joined = {"params": set(group["params"]), "saved": {node: grads.get(node) for node in nodes}}
        for other in overlapping:
            merged.remove(other)
            joined["params"] |= other["params"]
            for node, saved in other["saved"].items():
                if joined["saved"].get(node) is None:
                    joined["saved"][node] = saved
        merged.append(joined)
    return [_as_torch_group(group) for group in merged]


def _as_torch_group(group: dict) -> dict:
    """A merged group as `stage_backward_weight` reads it: the intermediates whose gradients were saved, and those."""
    saved = {node: grads for node, grads in group["saved"].items() if grads is not None}
    return {"params": group["params"], "intermediates": list(saved), "grads": list(saved.values())}


def _grad_version(param: nn.Parameter) -> tuple[int, int] | None:
    """Identifies the state of `param.grad`: a new tensor or an in-place addition changes it."""
    return None if param.grad is None else (id(param.grad), param.grad._version)


def build_schedule(
    stages: list[PipelineStage], schedule: PipelineSchedule, n_microbatches: int, loss_fn: Callable[..., torch.Tensor]
):
    """The schedule object; gradients are not rescaled, since `loss_fn` already divides by the global
    token count."""
    cls = schedule_class(schedule)
    if schedule.multi_stage:
        return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)


def sync_tied_gradients(
    grads: dict[str, torch.Tensor], tied: tuple[str, str], peer_rank: int, group: dist.ProcessGroup
) -> None:
    """Sums, in place, the gradients of the two copies of one weight that lives on two stages (tied
    embeddings). `grads` maps the copies this rank holds (by name) to their local gradients.

    When this rank holds both copies they are added locally; when it holds one, it swaps gradients
    with `peer_rank` (the pp rank holding the other) and both add them in the same order, so the
    copies stay bitwise equal.
    """
    if not grads:
        return
    if len(grads) == 2:
        total = grads[tied[0]] + grads[tied[1]]
    else:
        ((name, mine),) = grads.items()
        theirs = torch.empty_like(mine)
        if not mine.is_meta:  # a dry run's meta tensors have nothing to exchange (their buffer still counts)
            ops = [
                dist.P2POp(dist.isend, mine, group=group, group_peer=peer_rank),
                dist.P2POp(dist.irecv, theirs, group=group, group_peer=peer_rank),
            ]
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        total = mine + theirs if name == tied[0] else theirs + mine
    for grad in grads.values():
        grad.copy_(total)
