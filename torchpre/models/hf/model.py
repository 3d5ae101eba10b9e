"""`HFCausalLM`: a transformers causal LM, run by transformers' own forward, that can also be a pipeline stage.

`HFCausalLM` holds the submodules of the model `AutoModelForCausalLM.from_config` builds, under their own names
(`model.embed_tokens`, `transformer.h.3`, `lm_head`, ...: state dicts are transformers' own), and its forward is
the model's own forward: one process computes exactly what transformers computes.

A pipeline stage is a copy of it that holds some of those modules (`torchpre.parallel.pipeline.prune_to` sets the
others to None). While it runs, each module it lacks is replaced by a `PassThrough`, so transformers' forward runs
unchanged: a stage without the input embedding takes the previous stage's hidden states as `inputs_embeds`, a
missing decoder layer or final norm hands its input on, and a missing position-embedding table adds nothing. A
stage without the output layer returns the decoder's hidden states, the last stage the logits. Whether that
reproduces the architecture's forward is checked before any work, on a tiny model (`torchpre.models.hf.probe`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from torchpre.errors import ConfigError
from torchpre.models.hf.architectures import not_decoder_only
from torchpre.models.hf.args import HFArgs
from torchpre.models.hf.init import init_buffers, init_weights
from torchpre.optional import import_optional
from torchpre.parallel.api import pipeline_stages

__all__ = ["HFCausalLM", "PassThrough", "init_buffers", "init_weights", "split_stages"]


class PassThrough(nn.Module):
    """Stands in for a module a pipeline stage does not hold: it returns the hidden states it is given (a float
    tensor, the first argument or `hidden_states`), and for an index lookup (a position-embedding table given
    position ids) a zero that adds nothing. It carries the plain attributes (`attention_type`, `layer_idx`, ...)
    of the module it stands in for, which the model's forward may read."""

    def __init__(self, attributes: dict[str, Any] | None = None):
        super().__init__()
        self.__dict__.update(attributes or {})

    def forward(self, *args: object, **kwargs: object) -> Tensor:
        value = args[0] if args else kwargs.get("hidden_states", next(iter(kwargs.values()), None))
        if isinstance(value, Tensor) and value.is_floating_point():
            return value
        return torch.zeros((), device=value.device if isinstance(value, Tensor) else None)


class HFCausalLM(nn.Module):
    """The transformers causal LM that `args.config` describes, built with `AutoModelForCausalLM.from_config` in
    the default dtype (no weights are downloaded; the trainer initialises them or loads a checkpoint).

    `forward(tokens)` returns logits [batch, seq, vocab]; a later pipeline stage takes the hidden states the
    previous one returned. Under sequence parallelism the hidden states between blocks are this rank's slice of
    the sequence: `sequence_shards` (set by the tensor-parallel plan) says how many slices make the sequence, and
    the positions of the whole sequence are passed to the model.
    """

    def __init__(self, args: HFArgs):
        super().__init__()
        why = not_decoder_only(args.config.model_type)
        if why is not None:
            raise ConfigError(f"HFCausalLM: model_type = '{args.config.model_type}' is not trained by torchpre: {why}.")
        transformers = import_optional("transformers", "model.name = 'hf'", extra="hf")
        causal_lm = transformers.AutoModelForCausalLM.from_config(args.config, dtype=torch.get_default_dtype())
        self.config = args.config
        self.causal_lm_class = type(causal_lm)
        self.architecture = type(causal_lm).__name__
        names = {module: name for name, module in causal_lm.named_modules()}
        self.input_embedding = names[causal_lm.get_input_embeddings()]
        self.output_layer = names[causal_lm.get_output_embeddings()]
        self.blocks = block_container_name(causal_lm)
        self.decoder_path = self.blocks.split(".")[0]  # the model under the head: its forward returns hidden states
        # What a PassThrough standing in for each module must carry: its plain (non-tensor) attributes.
        self.attributes = {name: _plain_attributes(module) for name, module in causal_lm.named_modules() if name}
        _frozen_parameters_as_buffers(causal_lm)
        for name, child in causal_lm.named_children():
            self.add_module(name, child)
        # transformers' model object runs the forward; not registered, so that names and parameters are its
        # children's, once. Its children are these modules (a stage's copy keeps them shared: deepcopy's memo).
        object.__setattr__(self, "causal_lm", causal_lm)
        self.sequence_shards = 1

    def forward(self, inputs: Tensor) -> Tensor:
        kwargs: dict[str, Any] = {"use_cache": False}
        if self.holds(self.input_embedding):
            kwargs["input_ids"] = inputs
            seq_len = inputs.shape[1]
        else:
            kwargs["inputs_embeds"] = inputs
            seq_len = inputs.shape[1] * self.sequence_shards
        if self.sequence_shards > 1:
            kwargs["position_ids"] = torch.arange(seq_len, device=inputs.device).unsqueeze(0)
        if inputs.is_meta:
            # The dry run: transformers reads the position ids' values to detect packed sequences when it builds the
            # attention mask, and meta tensors have none. A causal mask given as a tensor is used as it is.
            causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=inputs.device).tril()
            kwargs["attention_mask"] = causal.expand(inputs.shape[0], 1, seq_len, seq_len)
        last = self.holds(self.output_layer)
        with self._passing_through():
            if last:
                return self.causal_lm(**kwargs).logits
            return self.causal_lm.get_submodule(self.decoder_path)(**kwargs).last_hidden_state

    def holds(self, name: str) -> bool:
        """Whether this model (or pipeline stage) holds the submodule `name`."""
        module: nn.Module | None = self
        for part in name.split("."):
            module = module._modules.get(part) if module is not None else None
        return module is not None

    @contextlib.contextmanager
    def _passing_through(self) -> Iterator[None]:
        """transformers' model object sees this stage's modules, with a PassThrough for each one it lacks."""
        missing = [
            (parent, f"{prefix}.{name}".lstrip("."), name)
            for prefix, parent in self.named_modules()
            for name, child in parent._modules.items()
            if child is None
        ]
        for name, child in self._modules.items():
            self.causal_lm._modules[name] = child
        self.causal_lm.training = self.training
        for parent, path, name in missing:
            parent._modules[name] = PassThrough(self.attributes.get(path))
            if parent is self:
                self.causal_lm._modules[name] = parent._modules[name]
        try:
            yield
        finally:
            for parent, _, name in missing:
                parent._modules[name] = None


def _frozen_parameters_as_buffers(model: nn.Module) -> None:
    """Parameters transformers does not train (`requires_grad=False`: routers' score-correction biases) become
    persistent buffers of the same name: kept in state dicts and checkpoints, left alone by the optimizer."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and not param.requires_grad:
                del module._parameters[name]
                module.register_buffer(name, param.detach(), persistent=True)


def _plain_attributes(module: nn.Module) -> dict[str, Any]:
    return {
        name: value
        for name, value in vars(module).items()
        if not name.startswith("_") and name != "training" and not isinstance(value, (Tensor, nn.Module))
    }


def block_container_name(model: nn.Module) -> str:
    """The dotted name of the container of the model's decoder layers: the ModuleList (or ModuleDict) of the most
    parameters (`model.layers`, `transformer.h`, `gpt_neox.layers`, ...)."""
    containers = {
        name: sum(p.numel() for p in module.parameters())
        for name, module in model.named_modules()
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and len(module) > 0
    }
    if not containers:
        raise ConfigError(f"{type(model).__name__} holds no list of decoder layers to split into pipeline stages.")
    return max(containers, key=containers.__getitem__)


def tied_weights(args: HFArgs) -> tuple[str, str] | None:
    """The (source, tied) parameter names of the model's one tied weight (the output layer tied to the input
    embedding), None when nothing is tied. More than one tied weight is a ConfigError: a parallel plan re-ties one."""
    causal_lm = meta_model(args).causal_lm
    ties = dict(causal_lm.all_tied_weights_keys)
    if len(ties) > 1:
        raise ConfigError(
            f"{type(causal_lm).__name__} ties {len(ties)} weights ({', '.join(ties)}); torchpre's parallel plans "
            "re-tie one (the output layer to the input embedding)."
        )
    return next(((source, target) for target, source in ties.items()), None)


def outside_blocks(model: HFCausalLM) -> list[str]:
    """The modules around the decoder layers (at every level of the layers' path), in registration order."""
    (names,) = pipeline_stages(model, 1, blocks=model.blocks)
    return [name for name in names if not name.startswith(f"{model.blocks}.")]


def split_stages(
    model: HFCausalLM,
    roles: dict[str, str],
    num_stages: int,
    split_points: Sequence[str] = (),
    *,
    embedding_layers: int = 0,
    output_layers: int = 0,
) -> list[list[str]]:
    """The module names of each pipeline stage: the decoder layers split as `pipeline_stages` splits them, the
    modules around them by their role in the forward (`roles`, from `torchpre.models.hf.probe`): "first" ones
    (the embeddings) on the first stage, "last" ones (final norm, output layer) on the last, "every" ones (rotary
    tables, whose output every layer takes) on every stage. `embedding_layers` and `output_layers` as in
    `torchpre.parallel.pipeline.split_layers`."""
    stages = pipeline_stages(
        model,
        num_stages,
        split_points=split_points,
        blocks=model.blocks,
        embedding_layers=embedding_layers,
        output_layers=output_layers,
    )
    layers = [[name for name in names if name.startswith(f"{model.blocks}.")] for names in stages]
    around = outside_blocks(model)
    for index, names in enumerate(layers):
        held = {"every"} | ({"first"} if index == 0 else set()) | ({"last"} if index == num_stages - 1 else set())
        names[:0] = [name for name in around if roles[name] in held and roles[name] != "last"]
        names.extend(name for name in around if roles[name] == "last" and "last" in held)
    return layers


def block_path(args: HFArgs) -> str:
    """The dotted name of the decoder layers' container of the model `args` describe."""
    return meta_model(args).blocks


def meta_model(args: HFArgs) -> HFCausalLM:
    with torch.device("meta"):
        return HFCausalLM(args)


def flops_per_token(args: HFArgs, num_params: int, seq_len: int) -> int:
    """Training FLOPs per token, as for torchpre's Llama (`torchpre.models.llama3.args.flops_per_token`): 6 per
    parameter used in a matmul (the embedding lookup is not, unless tied to the output layer) plus attention's
    12 x layers x (heads x head_dim) x seq_len."""
    config = args.config
    lookup_params = 0 if args.tie_word_embeddings else args.vocab_size * args.dim
    head_dim = getattr(config, "head_dim", None) or args.dim // args.n_heads
    return 6 * (num_params - lookup_params) + 12 * args.n_layers * args.n_heads * head_dim * seq_len
