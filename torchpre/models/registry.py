"""Model families by name: what `model.name` and `model.flavor` resolve to.

A family is a `ModelSpec`; `register_model("mymodel", spec)` makes `model.name = "mymodel"` train with
`python -m torchpre.train`, checkpoint, generate and (with an `hf` adapter) convert like the built-in Llama 3.
Register it in a module that `job.custom_import` names (every entry point imports it before checking the job),
or in your own launcher that calls `register_model` and then
`torchpre.runtime.cli.run_entry_point(torchpre.train.main, ...)` (docs/models.md, "Bring your own model").
"""

from __future__ import annotations

import difflib
import traceback
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from torchpre.config.job_config import JobConfig
from torchpre.distributed.parallel_dims import ParallelDims
from torchpre.errors import ConfigError, resolve_step
from torchpre.models.args import ModelArgs
from torchpre.models.hf_sources import Sources
from torchpre.parallel.api import pipeline_stages
from torchpre.parallel.context_parallel import ContextParallel
from torchpre.parallel.quantized_experts import GroupedMM


@dataclass(frozen=True)
class HFAdapter:
    """The mapping between a family's state dict and a Hugging Face model folder, for torchpre.convert, exports and
    loading a folder's weights straight into a sharded model.

    `hf_sources(args, folder_names)` says where each tensor of the model comes from in a folder holding those
    tensors (`torchpre.models.hf_sources`), so each rank reads only the boxes it holds; without it a folder does
    not load (`hf-to-dcp` and `checkpoint.initial_load_path` refuse it by name). `args_from_hf_config(config)` gives
    the family's args from a folder's config.json (`model.flavor = "from_hf"`), reading or refusing every field."""

    to_hf_state_dict: Callable[[Mapping[str, Tensor], ModelArgs], dict[str, Tensor]]
    from_hf_state_dict: Callable[[Mapping[str, Tensor], ModelArgs], dict[str, Tensor]]
    hf_config: Callable[..., dict[str, Any]]  # (args, **token ids, torch_dtype, max_position_embeddings)
    hf_config_mismatches: Callable[[Mapping[str, Any], ModelArgs], list[str]]
    hf_sources: Callable[[ModelArgs, Collection[str]], Sources] | None = None
    args_from_hf_config: Callable[[Mapping[str, Any]], ModelArgs] | None = None


@dataclass(frozen=True)
class ModelBuild:
    """How to build one family's plain model and measure it.

    `model_cls(args)` builds the plain model; the trainer builds it on the meta device, parallelizes it
    (see `torchpre.parallel.api`), materialises it and calls `init_weights(module, seed)`. `blocks` is the dotted
    path of its container of repeated blocks, or `blocks(args)` for a family whose path depends on its args;
    `extra_blocks(args)` the dotted paths of blocks outside it that activation checkpointing, compile and FSDP
    wrap as units too (`ParallelPlan.extra_blocks`: DeepSeek-V3's multi-token prediction blocks).
    - `init_buffers(module)` replaces `init_weights` when a checkpoint will overwrite the weights (a resume,
      `checkpoint.initial_load_path`): after `to_empty` it computes the buffers a checkpoint does not hold (the
      non-persistent ones: RoPE tables, counters), so no rank draws weights that the load then discards.
      Default: `module.init_buffers()` (`default_init_buffers`).
    - `output_layer`: the dotted path of the output layer, a bias-free nn.Linear from the final hidden states to the
      vocabulary whose output the model returns as its logits; training.loss_chunk_size replaces it by a
      `torchpre.parallel.chunked_output.ChunkedOutput` (the model then returns the hidden states). The family's
      tensor-parallel plan must give that module `VocabParallelOutput`. None: the chunked loss is refused.
    - `tied_weights(args)`: the two names of a weight shared by two modules (tied embeddings).
    - `flops_per_token(args, num_params, seq_len)` for MFU; default 6 x parameters.
    - `sublayers`: the names of a block's children that ZeRO-3 makes FSDP units of their own under
      `parallelism.fsdp_wrap = "sublayer"` (those a block has; its norms stay with the block). Empty: refused.
    """

    model_cls: Callable[[ModelArgs], nn.Module]
    blocks: str | Callable[[ModelArgs], str] = "layers"
    extra_blocks: Callable[[ModelArgs], tuple[str, ...]] = lambda args: ()
    init_weights: Callable[[nn.Module, int], None] = lambda module, seed: module.init_weights(seed)
    init_buffers: Callable[[nn.Module], None] = lambda module: default_init_buffers(module)
    output_layer: str | None = None
    tied_weights: Callable[[ModelArgs], tuple[str, str] | None] = lambda args: None
    flops_per_token: Callable[[ModelArgs, int, int], int] = lambda args, num_params, seq_len: 6 * num_params
    sublayers: tuple[str, ...] = ()


@dataclass(frozen=True)
class ParallelPlans:
    """How one family's model is split over a layout, and which layouts it refuses, before any work. A missing plan
    turns the matching parallelism into a clear error, never a silent no-op.

    - `tensor_parallel`: a `parallelize_module` plan, or `fn(module, tp_mesh, *, sequence_parallel,
      loss_parallel)` that shards a model or stage; `validate_tensor_parallel(args, tp)` rejects shapes
      that do not shard. `saves_sequence_shard`: the function also takes `save_sequence_shard`
      (parallelism.sequence_parallel_save_shard, `torchpre.parallel.sequence_gather`).
    - `recompute_mlp_activation(module)` makes each dense MLP of a model or stage keep only its projections' outputs
      for backward (activation_checkpoint.recompute_mlp_activation, `torchpre.parallel.mlp_activation`). None: refused.
    - `expert_parallel(module, ep_mesh)` shards the experts; `validate_expert_parallel(args, ep)`.
    - `context_parallel(module, cp)` makes a model's or stage's attention attend over the whole sequence while
      it holds cp's positions (`torchpre.parallel.context_parallel.ContextParallel`: its RoPE rows and `attend`).
    - `stage_modules(args, num_stages, split_points, *, embedding_layers, output_layers)` names the modules of each
      pipeline stage (the counts as in `torchpre.parallel.pipeline.split_layers`); default:
      read off the model's children around `ModelBuild.blocks` (`torchpre.parallel.api.pipeline_stages`).
    - `validate_layout(args, dims)` rejects a layout (a `ParallelDims`) the family cannot run, beyond the tensor- and
      expert-parallel shape checks above.
    - `compile_fullgraph`: False for blocks with data-dependent shapes, which compile around graph breaks.
    - `set_grouped_mm(module, grouped_mm)` makes the routed experts of a model or stage run their grouped matmuls
      through `grouped_mm` and returns how many layers it changed; `expert_matmul_dims(args, dims)` names the
      dimensions each rank's expert matmuls multiply (both for `quantize.experts`, torchpre.parallel.quantized_experts).
    """

    tensor_parallel: dict[str, ParallelStyle] | Callable[..., None] | None = None
    validate_tensor_parallel: Callable[[ModelArgs, int], None] = lambda args, tp: None
    expert_parallel: Callable[[nn.Module, DeviceMesh], None] | None = None
    validate_expert_parallel: Callable[[ModelArgs, int], None] = lambda args, ep: None
    context_parallel: Callable[[nn.Module, ContextParallel], None] | None = None
    stage_modules: Callable[..., list[list[str]]] | None = None
    validate_layout: Callable[[ModelArgs, ParallelDims], None] = lambda args, dims: None
    compile_fullgraph: bool = True
    saves_sequence_shard: bool = False
    recompute_mlp_activation: Callable[[nn.Module], None] | None = None
    set_grouped_mm: Callable[[nn.Module, GroupedMM], int] | None = None
    expert_matmul_dims: Callable[[ModelArgs, ParallelDims], dict[str, int]] | None = None


@dataclass(frozen=True)
class TrainingHooks:
    """What sets one family's training apart, called by the trainer for every family (the defaults do nothing), so
    that it never asks what a model is.

    - `set_aux_loss_scale(part, scale)`: for each model part, `scale` = 1 / global batch size. A family whose
      forward adds an auxiliary loss to the gradient (`torchpre.models.aux_loss.AddAuxLoss`; MoE load
      balancing) puts it into each sequence's term, so the terms add up to a mean over the global batch.
    - `set_token_loss_scale(part, scale)`: for each model part, `scale` = 1 / the step's token count (it changes
      with a batch ramp or a data stage's seq_len). A family whose forward adds a per-token loss to the gradient
      (DeepSeek-V3's multi-token prediction) divides its summed token losses by it, as the trainer's loss does.
    - `extra_metrics(parts, args, device)` returns values to log with each metrics record (MoE's router
      statistics). A collective: every rank calls it at each logged step, with the model parts it holds.
    - `after_optimizer_step(parts, args, device, skip)` updates training state that no optimizer steps (MoE's
      routing biases) after each optimizer step; `skip` is 1 where the step was not applied (a float, or a
      one-element tensor on the device when the optimizer skips there), 0 where it was. A collective: every rank
      calls it, once per step and once per dropped replay of one.
    - `tokens_ahead(args)`: how many tokens after each position the forward reads in training (multi-token
      prediction), which it gets as `future_tokens` [batch, seq, tokens_ahead] (`ForwardInputs`); 0: none.
    """

    set_aux_loss_scale: Callable[[nn.Module, float], None] = lambda part, scale: None
    set_token_loss_scale: Callable[[nn.Module, float], None] = lambda part, scale: None
    extra_metrics: Callable[[Sequence[nn.Module], ModelArgs, torch.device], dict[str, float]] = (
        lambda parts, args, device: {}
    )
    after_optimizer_step: Callable[[Sequence[nn.Module], ModelArgs, torch.device, Tensor | float], None] = (
        lambda parts, args, device, skip: None
    )
    tokens_ahead: Callable[[ModelArgs], int] = lambda args: 0


@dataclass(frozen=True)
class ModelSpec:
    """One model family: where its args come from, and its parts: how to build it (`build`), how to parallelize it
    (`parallel`), its training hooks (`hooks`) and its Hugging Face mapping (`hf`; None: no conversion).

    `flavors` maps a name to the family's args (`torchpre.models.args.ModelArgs`; the trainer sets `vocab_size` and
    `max_seq_len` from the tokenizer and `training.seq_len`). A family whose args come from elsewhere gives
    `args_from_job(job_config, tokenizer_vocab_size, max_seq_len)` instead (None: the model's own context),
    e.g. `model.name = "hf"` reads them from `model.hf_config`.
    """

    build: ModelBuild
    flavors: Mapping[str, ModelArgs] = field(default_factory=dict)
    args_from_job: Callable[[JobConfig, int, int | None], ModelArgs] | None = None
    parallel: ParallelPlans = ParallelPlans()
    hooks: TrainingHooks = TrainingHooks()
    hf: HFAdapter | None = None

    def blocks_of(self, args: ModelArgs) -> str:
        """The dotted path of the block container of the model `args` describe."""
        blocks = self.build.blocks
        return blocks(args) if callable(blocks) else blocks

    def pipeline_stages(
        self,
        args: ModelArgs,
        num_stages: int,
        split_points: Sequence[str] = (),
        *,
        embedding_layers: int = 0,
        output_layers: int = 0,
    ) -> list[list[str]]:
        """The module names of each of `num_stages` pipeline stages; `embedding_layers` and `output_layers` as in
        `torchpre.parallel.pipeline.split_layers`."""
        counts = {"embedding_layers": embedding_layers, "output_layers": output_layers}
        if self.parallel.stage_modules is not None:
            return self.parallel.stage_modules(args, num_stages, split_points, **counts)
        with torch.device("meta"):
            model = self.build.model_cls(args)
        return pipeline_stages(model, num_stages, split_points=split_points, blocks=self.blocks_of(args), **counts)


def default_init_buffers(module: nn.Module) -> None:
    """Calls `module.init_buffers()`. A module without that method must hold no non-persistent buffers: a
    checkpoint does not save them, so skipping `init_weights` would leave them as `to_empty` left them."""
    init = getattr(module, "init_buffers", None)
    if callable(init):
        init()
        return
    computed = [
        f"{prefix}.{name}".lstrip(".")
        for prefix, child in module.named_modules()
        for name in child._non_persistent_buffers_set
        if child._buffers.get(name) is not None
    ]
    if computed:
        raise TypeError(
            f"{type(module).__name__} has non-persistent buffers ({', '.join(computed[:5])}) that a checkpoint "
            "does not hold, and no init_buffers() to compute them when the weights come from a checkpoint. Give "
            "the model an init_buffers() method (or its ModelSpec an init_buffers hook) that fills them."
        )


_REGISTRY: dict[str, ModelSpec] = {}
_REGISTERED_AT: dict[str, str] = {}  # name -> "file:line" of the register_model call


def register_model(name: str, spec: ModelSpec) -> None:
    """Makes `model.name = name` available to torchpre.train, torchpre.generate and torchpre.convert.

    A name is registered once. Registering the same spec object again does nothing, and a module imported
    a second time (reloaded, or imported under another name) may register its new spec from the same line;
    another spec under a taken name is a ValueError naming both places (a bug in the code that registers, not a key
    the user can change).
    """
    caller = traceback.extract_stack(limit=2)[0]
    place = f"{caller.filename}:{caller.lineno}"
    for flavor, args in spec.flavors.items():
        if not isinstance(args, ModelArgs):
            raise TypeError(
                f"register_model('{name}', ...) at {place}: the args of its flavor '{flavor}' "
                f"({type(args).__name__}) do not declare what torchpre reads of a model's args "
                "(torchpre.models.args.ModelArgs). Derive the args class from torchpre.models.args.ArgsDefaults, "
                "which declares the optional features as absent."
            )
    if name in _REGISTRY and _REGISTRY[name] is not spec and _REGISTERED_AT[name] != place:
        raise ValueError(
            f"register_model('{name}', ...) at {place}: the name '{name}' is taken, registered at "
            f"{_REGISTERED_AT[name]}. Give this model family another name."
        )
    _REGISTRY[name] = spec
    _REGISTERED_AT.setdefault(name, place)


@resolve_step
def get_model_spec(name: str) -> ModelSpec:
    if name not in _REGISTRY:
        raise ConfigError(f"model.name = '{name}' is not a registered model.{suggest_name(name, _REGISTRY)}")
    return _REGISTRY[name]


def get_flavor(name: str, flavor: str) -> ModelArgs:
    """The args of `model.flavor = flavor` of the family `model.name = name`, a flavor the [model] step checked
    (`torchpre.assembly.args.flavor_args`)."""
    return get_model_spec(name).flavors[flavor]


def suggest_name(name: str, choices: Mapping[str, object]) -> str:
    """The end of a message refusing `name`: the closest of `choices`, if any is close, and all of them."""
    close = difflib.get_close_matches(name, choices, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return f"{hint} Choose one of: {', '.join(choices)}."
