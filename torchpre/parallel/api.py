"""The public parallelize API: any `nn.Module` and a DeviceMesh in, this rank's parallel model out.

    from torchpre.optim import build_optimizer
    from torchpre.parallel import ParallelPlan, PipelinePlan, parallelize, pipeline_stages

    with torch.device("meta"):
        model = MyModel(args)
    plan = ParallelPlan(
        tensor_parallel={"blocks.*.mlp.fc": ColwiseParallel(), "blocks.*.mlp.proj": RowwiseParallel()},
        pipeline=PipelinePlan.build(pipeline_stages(model, 2, blocks="blocks"), pp=2, n_microbatches=4),
        blocks="blocks", activation_checkpoint="full", compile=True,
    )
    parallel = parallelize(model, mesh, plan, device=device, init_weights=lambda m: m.init_weights(seed),
                           loss_fn=loss_fn)
    optimizer = build_optimizer(parallel, zero_stage=1, lr=3e-4)
    loss = parallel.forward_backward([(inputs, labels)])
    grad_norm = optimizer.step()

The model can be anyone's, unmodified: a transformers `LlamaForCausalLM` takes tensor-parallel keys such as
"model.layers.*.self_attn.q_proj" and `blocks="model.layers"`; `loss_fn(output, labels)` receives what the model
returns (a tensor, a tuple, or an output object with `.logits`; `logits_of(output)` reads the logits of any of them).

`mesh` has the dimensions ("pp", "dp", "tp") (`ParallelDims.build_mesh`); models with experts also take
an expert mesh ("pp", "edp", "ep", "tp") (`ParallelDims.build_meshes(...).expert_mesh`). ZeRO-3 adds
`fsdp=FSDPPlan(...)` to the plan and `dp_mesh=meshes.fsdp_mesh` (`ParallelDims.build_meshes(..., fsdp=True)`,
whose views share one root with `meshes.mesh`), then `build_optimizer(parallel, zero_stage=3)`. What the
model must do:
- for pipeline parallelism, skip the submodules a pipeline stage does not hold: `pipeline_stages` names the
  modules around the `blocks` container (a dotted path) and its entries; `prune_to` sets the others to None
  (a ModuleList keeps its indices, a ModuleDict drops the key), and the forward must then pass its input
  through (e.g. `h = self.embed(x) if self.embed is not None else x`). `torchpre.models.hf.HFCausalLM` is
  such a forward for transformers' Llama-family decoders;
- be initialised by `init_weights(module)` once it is materialised, identically for any layout
  (`torchpre.models.init.init_parameters` draws each parameter from (seed, its name));
- share a Parameter between modules (tied embeddings) on the model as given: `parallelize` finds every shared
  Parameter there, re-ties it after sharding and materialising, and has the optimizer sum the two copies'
  gradients when they live on the first and the last pipeline stage; a layout that cannot keep one weight (a
  tensor-parallel plan sharding the copies unlike each other, copies on other stages) is refused by name
  (`parallel.ties`). `tied_weights = ("embed.weight", "head.weight")` ties a pair the model does not share itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle

from torchpre.distributed.clock import SpanClock
from torchpre.distributed.names import canonical_fqn
from torchpre.errors import ConfigError
from torchpre.parallel.activation_checkpoint import BlockSlot, apply_activation_checkpointing, slots
from torchpre.parallel.compile import compile_blocks
from torchpre.parallel.data_parallel import FSDPPlan, apply_fsdp
from torchpre.parallel.pipeline import HookedPipelineStage, PipelinePlan, build_schedule, prune_to, split_layers
from torchpre.parallel.tensor_parallel import apply_tensor_parallel, check_plan
from torchpre.parallel.ties import check_tied_placements, cross_stage_pair, retie, tie_groups
from torchpre.step_rules.schedules import names_where

TensorParallelPlan = dict[str, ParallelStyle] | Callable[[nn.Module, DeviceMesh], None]
"""A `parallelize_module` plan (keys are fnmatch paths such as "blocks.*.mlp.fc"), or a function that
shards a model or pipeline stage in place over the 1-D tp mesh."""

class HasLogits(Protocol):
    """A model output object (transformers' `CausalLMOutputWithPast`)."""

    logits: torch.Tensor


ForwardOutput: TypeAlias = Union[torch.Tensor, tuple[torch.Tensor, ...], list[torch.Tensor], HasLogits]
"""What a model's forward returns: the logits, a tuple or list that they lead, or an object holding them."""

ExpertParallelPlan = Callable[[nn.Module, DeviceMesh], None]
"""A function that shards a model's experts in place over the 1-D ep mesh (see `parallel.expert_parallel`).
It runs before the tensor-parallel plan, which then finds those experts as ep-mesh DTensors."""

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class ParallelPlan:
    """How to parallelize one model: everything beyond the mesh that `parallelize` needs.

    `blocks` is the dotted path of the container (a ModuleDict or ModuleList, e.g. "layers" or "model.layers")
    of repeated blocks: activation checkpointing and torch.compile apply per block (they need it), FSDP shards
    per block (without it, the whole part at once), and pipeline stages split it. A plan that only shards
    over TP and DP needs none. `compile_fullgraph = False` is for blocks
    with data-dependent shapes (Mixture of Experts). `fsdp` shards the parameters over DP with FSDP2
    (ZeRO-3, see `parallel.data_parallel`); `parallelize` then needs the DP mesh. `context_parallel` makes a
    part's attention context-parallel in place (a family's `ModelSpec.parallel.context_parallel` bound to this rank's
    `parallel.context_parallel.ContextParallel`); it runs after the tensor-parallel plan and before activation
    checkpointing, which then recomputes the key/value gather with the rest of a block. `recompute_mlp_activation`
    (a family's `ModelSpec.parallel.recompute_mlp_activation`) makes a part's dense MLPs keep only their projections'
    outputs for backward; it runs after the tensor-parallel plan. `extra_blocks` are the
    dotted paths of blocks outside that container (DeepSeek-V3's multi-token prediction blocks,
    "mtp.depths.1.block", ...): activation checkpointing, compile and FSDP make each one more unit, after the
    container's, in the part that holds it; a pipeline split leaves them with the modules around the container.
    `parallelize` keeps the Parameters the model shares tied by itself; `tied_weights` names a pair to tie that the
    model built on the meta device does not share (and, under pipeline parallelism, the pair whose two copies'
    gradients the optimizer sums).
    """

    tensor_parallel: TensorParallelPlan | None = None
    expert_parallel: ExpertParallelPlan | None = None
    pipeline: PipelinePlan | None = None
    blocks: str | None = None
    extra_blocks: tuple[str, ...] = ()
    tied_weights: tuple[str, str] | None = None
    activation_checkpoint: str = "none"
    selective_ac_option: str = "op"
    compile: bool = False
    compile_fullgraph: bool = True
    fsdp: FSDPPlan | None = None
    context_parallel: Callable[[nn.Module], None] | None = None
    recompute_mlp_activation: Callable[[nn.Module], None] | None = None


def pipeline_stages(
    model: nn.Module,
    num_stages: int | None = None,
    *,
    layers_per_stage: Sequence[int] | None = None,
    split_points: Sequence[str] = (),
    blocks: str = "layers",
    embedding_layers: int = 0,
    output_layers: int = 0,
) -> list[list[str]]:
    """The module names each pipeline stage holds, read off the model's structure: the modules defined before
    the `blocks` container (at each level of its dotted path) go to the first stage, those after it to the
    last, and the blocks are split evenly, by `layers_per_stage` counts, or at `split_points` (the first block
    name of each later stage). An even split may count the modules before the blocks as `embedding_layers` blocks
    and those after as `output_layers` (`split_layers`): the first or the last stage may then hold no block.

    For a GPT-2-like model, `pipeline_stages(model, 2, blocks="h")` gives
    [["wte", "wpe", "h.0", "h.1"], ["h.2", "h.3", "ln_f", "lm_head"]]; for a transformers Llama,
    `blocks="model.layers"` gives [["model.embed_tokens", "model.layers.0", ...], [..., "model.norm",
    "model.rotary_emb", "lm_head"]].
    """
    container = block_container(model, blocks, "pipeline_stages(blocks=...)")
    layers = [f"{blocks}.{key}" for key, _ in container.named_children()]
    if layers_per_stage is not None:
        if sum(layers_per_stage) != len(layers) or min(layers_per_stage) < 1:
            raise ConfigError(
                f"layers_per_stage {list(layers_per_stage)} must be positive and add up to the {len(layers)} "
                f"blocks of '{blocks}'."
            )
        starts = [sum(layers_per_stage[:i]) for i in range(1, len(layers_per_stage))]
        split_points, num_stages = [layers[s] for s in starts], len(layers_per_stage)
    if num_stages is None:
        raise ConfigError("pipeline_stages needs num_stages or layers_per_stage.")
    stages = split_layers(
        layers, num_stages, split_points, embedding_layers=embedding_layers, output_layers=output_layers
    )
    before, after = _around(model, blocks)
    stages[0][:0] = before
    stages[-1].extend(after)
    return stages


def block_container(model: nn.Module, blocks: str | None, needed_by: str) -> nn.Module:
    """The module at the dotted path `blocks` (ParallelPlan.blocks), or a ConfigError naming what needs it."""
    if blocks is None:
        raise ConfigError(
            f"{needed_by} applies per block: set ParallelPlan.blocks to the dotted path of the container of the "
            "model's repeated blocks (e.g. 'layers' or 'model.layers')."
        )
    try:
        return model.get_submodule(blocks)
    except AttributeError:
        children = [name for name, _ in model.named_children()]
        raise ConfigError(
            f"The model {type(model).__name__} has no submodule '{blocks}' holding its blocks ({needed_by}); "
            f"its children: {', '.join(children)}."
        ) from None


def block_slots(part: nn.Module, plan: ParallelPlan, needed_by: str) -> list[BlockSlot]:
    """The units of the per-block wrappers in `part`: the entries of `plan.blocks`, then each of `plan.extra_blocks`
    this part holds (a pipeline stage may not)."""
    found = slots(block_container(part, plan.blocks, needed_by))
    for path in plan.extra_blocks:
        owner, _, name = path.rpartition(".")
        try:
            parent = part.get_submodule(owner)
        except AttributeError:  # pruned away by the pipeline split
            continue
        if getattr(parent, name, None) is not None:
            found.append((parent, name))
    return found


def _around(model: nn.Module, path: str) -> tuple[list[str], list[str]]:
    """The names of the modules registered before and after each module on `path` (its siblings at every level)."""
    before: list[str] = []
    after: list[str] = []
    module, prefix = model, ""
    for name in path.split("."):
        siblings = [child for child, _ in module.named_children()]
        position = siblings.index(name)
        before += [prefix + child for child in siblings[:position]]
        after[:0] = [prefix + child for child in siblings[position + 1 :]]  # inner ones run before outer ones
        module, prefix = getattr(module, name), f"{prefix}{name}."
    return before, after


def logits_of(output: ForwardOutput) -> torch.Tensor:
    """The logits in what a model returns: the tensor itself, a tuple's first element, or an output object's
    `.logits` (transformers' `CausalLMOutputWithPast`)."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if logits is not None:
        return logits
    if isinstance(output, (tuple, list)) and output:
        return output[0]
    raise TypeError(
        f"Cannot find logits in a {type(output).__name__}: return a tensor, a tuple or an object with .logits."
    )


class ParallelModel:
    """This rank's part of a parallelized model: its modules (`parts`: the whole model, or its pipeline
    stages) and, under pipeline parallelism, the schedule that runs them.

    `forward_backward` accumulates gradients over microbatches and returns this rank's share of the loss
    (`loss_fn`'s values summed; 0 on pipeline ranks without the last stage). Gradients are not averaged:
    `loss_fn` decides the normalisation (the trainer divides summed token losses by the global token
    count, which makes any layout sum to the same global mean).
    """

    def __init__(
        self,
        parts: list[nn.Module],
        mesh: DeviceMesh,
        plan: ParallelPlan,
        device: torch.device,
        loss_fn: Callable[[ForwardOutput, torch.Tensor], torch.Tensor] | None,
        expert_mesh: DeviceMesh | None,
        dp_mesh: DeviceMesh | None = None,
    ):
        self.parts, self.mesh, self.plan, self.device = parts, mesh, plan, device
        self.loss_fn, self.expert_mesh, self.dp_mesh = loss_fn, expert_mesh, dp_mesh
        pipeline = plan.pipeline
        self.stage_ids = pipeline.stage_ids(mesh["pp"].get_local_rank()) if pipeline else [0]
        num_stages = pipeline.num_stages if pipeline else 1
        self.has_first_stage, self.has_last_stage = 0 in self.stage_ids, num_stages - 1 in self.stage_ids
        self._stages: list[HookedPipelineStage] = []  # those of the schedule running now
        self._backward_callback: Callable[[int, bool], None] | None = None
        # The compute time of this rank's stages in training steps (not evaluation): see `pipeline_busy_seconds`.
        self._pipeline_clock = SpanClock(device)
        # Schedules by (microbatches, batch shape): torch's stages size their buffers from the first batch they
        # run, so another shape (a ramp's batch, a data stage's seq_len) gets stages and a schedule of its own.
        self._schedules: dict[tuple[int, tuple[int, ...]], tuple[Any, list[HookedPipelineStage]]] = {}

    def _schedule_for(self, n_microbatches: int, inputs: torch.Tensor):
        """The schedule that runs `inputs` [batch, ...] as `n_microbatches`, built on first use; its stages become
        the ones running now. Without a loss_fn (inference) there is none: `forward_only` passes activations
        itself."""
        if self.loss_fn is None:
            raise ConfigError("Pipeline parallelism needs a loss_fn: the last stage computes the loss.")
        key = (n_microbatches, tuple(inputs.shape))
        if key not in self._schedules:
            pipeline, group = self.plan.pipeline, self.mesh["pp"].get_group()
            stages = [
                HookedPipelineStage(part, stage, pipeline.num_stages, self.device, group=group, part_index=index)
                for index, (part, stage) in enumerate(zip(self.parts, self.stage_ids))
            ]
            for stage in stages:
                stage.backward_callback = self._backward_callback
            schedule = build_schedule(stages, pipeline.schedule, n_microbatches, self._stage_loss)
            self._schedules[key] = (schedule, stages)
        schedule, self._stages = self._schedules[key]
        return schedule

    def _stage_loss(self, output: ForwardOutput, labels: torch.Tensor) -> torch.Tensor:
        """`loss_fn` as the last stage's schedule calls it, timed as stage compute while a step is timed."""
        clock = self._stages[0].clock
        with clock.span("compute") if clock is not None else contextlib.nullcontext():
            return self.loss_fn(output, labels)

    def pipeline_busy_seconds(self) -> float:
        """Seconds this rank's stages computed (forward, backward, weight backward, loss) in `forward_backward`
        calls since the last call: a schedule step's time less this is the rank's share of the pipeline bubble
        (waiting for peers and P2P). On CUDA measured with events, read here (one device sync)."""
        return self._pipeline_clock.totals().get("compute", 0.0)

    def set_backward_callback(self, callback: Callable[[int, bool], None] | None) -> None:
        """Has `forward_backward` call `callback(part_index, last)` before each backward that produces parameter
        gradients of `parts[part_index]`; `last` is true for the step's last one. The optimizer starts its
        data-parallel reduction during that backward (`GradBuckets.on_backward`)."""
        self._backward_callback = callback
        for _, stages in self._schedules.values():
            for stage in stages:
                stage.backward_callback = callback

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Every parameter this rank holds, once, by its name in the full model (wrapper names removed)."""
        named: dict[str, nn.Parameter] = {}
        for part in self.parts:
            named.update((canonical_fqn(name), param) for name, param in part.named_parameters())
        return list(named.items())

    def tied_peer(self) -> int | None:
        """Under pipeline parallelism with tied weights, the pp rank holding the copy of the tied weight that this
        rank does not: the stages of the first and the last block hold one each (the same rank under V
        schedules, whose two stage copies are summed locally). None when one module holds both."""
        pipeline = self.plan.pipeline
        if pipeline is None or self.plan.tied_weights is None:
            return None
        first, last = pipeline.stage_rank(0), pipeline.stage_rank(pipeline.num_stages - 1)
        return last if self.mesh["pp"].get_local_rank() == first else first

    def forward_backward(
        self, microbatches: Sequence[Batch], forward_kwargs: Callable[[torch.Tensor], dict] = lambda inputs: {}
    ) -> torch.Tensor:
        """Runs forward and backward over `microbatches` (inputs, labels) on this rank.

        Without a pipeline each microbatch runs `parts[0](inputs, **forward_kwargs(inputs))` and
        `loss_fn(output, labels)`; with one, all microbatches go through one schedule step, cut into the
        plan's pipeline microbatches, and `forward_kwargs` of the whole batch (tensors [batch, ...], such as the
        document ids) are cut with them and go to every stage's forward of each microbatch.
        """
        if self.plan.pipeline is not None:
            return self._pipeline_forward_backward(microbatches, forward_kwargs)
        loss = torch.zeros((), device=self.device)
        for i, (inputs, labels) in enumerate(microbatches):
            microbatch_loss = self.loss_fn(self.parts[0](inputs, **forward_kwargs(inputs)), labels)
            if self._backward_callback is not None:
                self._backward_callback(0, i == len(microbatches) - 1)
            microbatch_loss.backward()
            loss += replicated_value(microbatch_loss.detach())
        return loss

    def _pipeline_forward_backward(
        self, microbatches: Sequence[Batch], forward_kwargs: Callable[[torch.Tensor], dict]
    ) -> torch.Tensor:
        inputs = torch.cat([x for x, _ in microbatches])
        labels = torch.cat([y for _, y in microbatches])
        schedule = self._schedule_for(self.plan.pipeline.microbatches_in(len(inputs)), inputs)
        for stage in self._stages:
            stage.clock = self._pipeline_clock
        try:
            losses = self._run_schedule(schedule.step, inputs, labels, forward_kwargs(inputs))
        finally:
            for stage in self._stages:
                stage.clock = None
        if not losses:
            return torch.zeros((), device=self.device)
        return torch.stack([replicated_value(loss.detach()) for loss in losses]).sum()

    @torch.no_grad()
    def forward_only(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor | None = None,
        forward_kwargs: Callable[[torch.Tensor], dict] = lambda inputs: {},
    ) -> torch.Tensor | None:
        """The forward pass without autograd, for evaluation and decoding; None on ranks without the last stage.

        With `labels`, this rank's share of the loss in `loss_fn`'s units, as `forward_backward` returns it:
        under pipeline parallelism from one forward-only run of the schedule (`schedule.eval`, its microbatches
        and its loss_fn), which the schedule table must allow (`forward_only`). Without labels, the last stage's
        output (the logits): under pipeline parallelism the activations of the whole batch go stage to stage by
        point-to-point sends, so any shape runs (a prompt, then one token at a time) and every rank calls this
        with the same `inputs`. `forward_kwargs(inputs)` goes to every part's forward (e.g. a KV cache's
        `start_pos`); under a schedule, cut into its microbatches as in `forward_backward`.
        """
        if labels is None:
            output = self._forward_stages(inputs, forward_kwargs(inputs))
            return None if output is None else logits_of(output)
        if self.plan.pipeline is None:
            return replicated_value(self.loss_fn(self.parts[0](inputs, **forward_kwargs(inputs)), labels))
        if not self.plan.pipeline.schedule.forward_only:
            raise ConfigError(
                f"The '{self.plan.pipeline.schedule.name}' pipeline schedule cannot run forward-only (schedule.eval); "
                f"use one of {', '.join(names_where(forward_only=True))}."
            )
        schedule = self._schedule_for(self.plan.pipeline.n_microbatches, inputs)
        losses = self._run_schedule(schedule.eval, inputs, labels, forward_kwargs(inputs))
        return torch.stack([replicated_value(loss) for loss in losses]).sum() if losses else None

    def _run_schedule(
        self, run: Callable, inputs: torch.Tensor, labels: torch.Tensor, kwargs: dict[str, torch.Tensor]
    ) -> list[torch.Tensor]:
        """One `schedule.step` or `schedule.eval` over the batch; the losses of the microbatches on the last
        stage, none elsewhere. `return_outputs=False` keeps the last stage from holding every microbatch's output.
        The schedule cuts `kwargs` into microbatches like the inputs and passes them to every stage (on every
        rank: a later stage receives its activations from the previous one, but not these)."""
        losses: list[torch.Tensor] = []
        targets = {"target": labels, "losses": losses} if self.has_last_stage else {}
        args = (inputs,) if self.has_first_stage else ()
        run(*args, **targets, **kwargs, return_outputs=False)
        return losses

    @property
    def last_part(self) -> nn.Module | None:
        """The part holding the last stage (the whole model without a pipeline); None on ranks without it."""
        if not self.has_last_stage:
            return None
        return self.parts[self.stage_ids.index(self.plan.pipeline.num_stages - 1 if self.plan.pipeline else 0)]

    @property
    def last_stage_rank(self) -> int:
        """The pp rank holding the last stage (0 without a pipeline)."""
        pipeline = self.plan.pipeline
        return pipeline.stage_rank(pipeline.num_stages - 1) if pipeline else 0

    def _forward_stages(self, inputs: torch.Tensor, kwargs: dict) -> torch.Tensor | None:
        """Runs the stages in order, sending each output to the rank of the next stage (its shape and dtype
        first, since they follow the input's); returns the last stage's output there, None elsewhere."""
        pipeline = self.plan.pipeline
        if pipeline is None:
            return self.parts[0](inputs, **kwargs)
        group, rank = self.mesh["pp"].get_group(), self.mesh["pp"].get_local_rank()
        held = dict(zip(self.stage_ids, self.parts))
        h = inputs
        for stage in range(pipeline.num_stages):
            if stage not in held:
                continue
            source = pipeline.stage_rank(stage - 1) if stage > 0 else rank
            if source != rank:
                h = _recv_tensor(source, group, self.device)
            h = held[stage](h, **kwargs)
            target = pipeline.stage_rank(stage + 1) if stage + 1 < pipeline.num_stages else rank
            if target != rank:
                _send_tensor(h, target, group, self.device)
        return h if self.has_last_stage else None


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    plan: ParallelPlan,
    *,
    device: torch.device,
    init_weights: Callable[[nn.Module], None],
    loss_fn: Callable[[ForwardOutput, torch.Tensor], torch.Tensor] | None = None,
    expert_mesh: DeviceMesh | None = None,
    dp_mesh: DeviceMesh | None = None,
    expert_dp_mesh: DeviceMesh | None = None,
) -> ParallelModel:
    """Splits `model` (built on the meta device) into this rank's pipeline stages, shards each over the tp
    (and ep) mesh, applies activation checkpointing and torch.compile per block, shards it over `dp_mesh`
    with FSDP2 when `plan.fsdp` asks (outermost: around the checkpointed, compiled blocks), materialises it on
    `device` and initialises it with `init_weights`.

    `dp_mesh` must share its root with `mesh` (`ParallelDims.build_meshes`' `dense_mesh["dp_shard"]`, or
    `["dp_replicate", "dp_shard"]` for HSDP), so that FSDP can combine it with the tp mesh; `expert_dp_mesh`
    (`Meshes.expert_fsdp_mesh`) with the ep mesh. A dict
    tensor-parallel plan is checked against the whole model first, so a key naming a missing module is an
    error even when no stage of this rank holds it.
    """
    if isinstance(plan.tensor_parallel, dict):
        check_plan(model, plan.tensor_parallel)
    if plan.fsdp is not None and dp_mesh is None:
        raise ConfigError("ParallelPlan.fsdp shards over data parallelism: pass parallelize(..., dp_mesh=...).")
    ties = tie_groups(model, plan.tied_weights)  # on the model as given: materialising unties them
    if plan.pipeline is not None:
        pair = cross_stage_pair(ties, plan.pipeline.stage_modules)
        plan = dataclasses.replace(plan, tied_weights=pair or plan.tied_weights)
        ids = plan.pipeline.stage_ids(mesh["pp"].get_local_rank())
        parts = [prune_to(model, plan.pipeline.stage_modules[stage]) for stage in ids]
    else:
        parts = [model]
    tp_mesh = mesh["tp"]
    for part in parts:
        # Experts first, so a tensor-parallel plan finds them placed on the ep mesh and can leave them be.
        if plan.expert_parallel is not None and expert_mesh is not None and expert_mesh["ep"].size() > 1:
            plan.expert_parallel(part, expert_mesh["ep"])
        if plan.tensor_parallel is not None and tp_mesh.size() > 1:
            apply_tensor_parallel_plan(part, tp_mesh, plan.tensor_parallel)
            check_tied_placements(part, ties)
        if plan.context_parallel is not None:
            plan.context_parallel(part)
        if plan.recompute_mlp_activation is not None:
            plan.recompute_mlp_activation(part)
        if plan.activation_checkpoint != "none":
            blocks = block_slots(part, plan, f"activation_checkpoint = '{plan.activation_checkpoint}'")
            apply_activation_checkpointing(blocks, plan.activation_checkpoint, plan.selective_ac_option)
        if plan.compile:
            per_child = tp_mesh.size() > 1 or plan.fsdp is not None
            blocks = block_slots(part, plan, "compile")
            compile_blocks(_held(blocks), per_child=per_child, fullgraph=plan.compile_fullgraph)
        if plan.fsdp is not None:
            retie(part, ties)  # before sharding: a tied Parameter must be one FSDP parameter
            blocks = [] if plan.blocks is None else block_slots(part, plan, "FSDP")
            apply_fsdp(part, dp_mesh, plan.fsdp, _held(blocks), expert_dp_mesh)
        part.to_empty(device=device)
        retie(part, ties)
        init_weights(part)
    return ParallelModel(parts, mesh, plan, device, loss_fn, expert_mesh, dp_mesh)


def _held(blocks: Sequence[BlockSlot]) -> list[nn.Module]:
    """The modules in the slots now (an activation-checkpoint wrapper where one took a block's place)."""
    return [parent.get_submodule(name) for parent, name in blocks]


def apply_tensor_parallel_plan(part: nn.Module, tp_mesh: DeviceMesh, plan: TensorParallelPlan) -> None:
    """A function plan shards the part itself; a dict plan is applied to the keys this stage holds."""
    if callable(plan):
        plan(part, tp_mesh)
        return
    held = {key: style for key, style in plan.items() if _resolves(part, key)}
    apply_tensor_parallel(part, tp_mesh, held)


def _resolves(module: nn.Module, key: str) -> bool:
    try:
        check_plan(module, {key: None})
    except ConfigError:
        return False
    return True


def _send_tensor(tensor: torch.Tensor, peer: int, group: dist.ProcessGroup, device: torch.device) -> None:
    dist.send_object_list([(tuple(tensor.shape), tensor.dtype)], group=group, group_dst=peer, device=device)
    dist.send(tensor.contiguous(), group=group, group_dst=peer)


def _recv_tensor(peer: int, group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    header: list = [None]
    dist.recv_object_list(header, group=group, group_src=peer, device=device)
    shape, dtype = header[0]
    tensor = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(tensor, group=group, group_src=peer)
    return tensor


def replicated_value(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor for a loss that may be a replicated DTensor (under loss parallel)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
