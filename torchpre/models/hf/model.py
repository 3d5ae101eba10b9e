"""`HFCausalLM`: a transformers Llama-layout causal LM, its submodules run in the model's own order.

transformers' `LlamaForCausalLM.forward` needs every layer and builds positions and masks from the hidden
states' length, so it can neither run a pipeline stage that holds a slice of the layers nor a residual stream
sharded over the sequence. `HFCausalLM` holds the same submodules under the same names (`model.embed_tokens`,
`model.layers.{i}`, `model.norm`, `model.rotary_emb`, `lm_head`, so state dicts are transformers' own) and
calls them as `LlamaModel.forward` does, skipping those a stage does not hold, with the rotary embeddings of
the whole sequence and causal attention (no mask tensor).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from torchpre.distributed.names import canonical_fqn
from torchpre.models.hf.args import HFArgs
from torchpre.models.init import ParamInit, init_parameters, ones, zeros
from torchpre.optional import import_optional
from torchpre.parallel.api import pipeline_stages

BLOCKS = "model.layers"
ROTARY = "model.rotary_emb"
EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"


class HFCausalLM(nn.Module):
    """The transformers causal LM that `args.config` describes, built with `AutoModelForCausalLM.from_config`
    in the default dtype (no weights are downloaded; the trainer initialises them or loads a checkpoint).

    `forward(tokens)` returns logits [batch, seq, vocab]; a later pipeline stage takes the hidden states the
    previous one returned. Under sequence parallelism the hidden states between blocks are this rank's slice of
    the sequence: `sequence_shards` (set by the tensor-parallel plan) says how many slices make the sequence.
    """

    def __init__(self, args: HFArgs):
        super().__init__()
        transformers = import_optional("transformers", "model.name = 'hf'", extra="hf")
        causal_lm = transformers.AutoModelForCausalLM.from_config(args.config, dtype=torch.get_default_dtype())
        self.config = args.config
        self.architecture = type(causal_lm).__name__
        self.model = causal_lm.model
        self.lm_head = causal_lm.lm_head
        self.sequence_shards = 1

    def forward(self, inputs: Tensor) -> Tensor:
        model = self.model
        h = model.embed_tokens(inputs) if model.embed_tokens is not None else inputs
        positions = torch.arange(h.shape[1] * self.sequence_shards, device=h.device).unsqueeze(0)
        position_embeddings = model.rotary_emb(h, positions)
        for layer in model.layers:
            if layer is not None:
                h = layer(h, position_embeddings=position_embeddings, position_ids=positions)
        if model.norm is not None:
            h = model.norm(h)
        return self.lm_head(h) if self.lm_head is not None else h


def tied_weights(args: HFArgs) -> tuple[str, str] | None:
    """With tie_word_embeddings, the input embedding and the output layer are one weight."""
    return (EMBEDDING, HEAD) if args.tie_word_embeddings else None


def decoder_stages(model: nn.Module, num_stages: int, split_points: Sequence[str] = ()) -> list[list[str]]:
    """The module names of each pipeline stage: the embedding with the first blocks, the final norm and the
    output layer with the last, and the rotary embedding (no parameters, it computes cos/sin) in every stage."""
    stages = pipeline_stages(model, num_stages, split_points=split_points, blocks=BLOCKS)
    return [[name for name in names if name != ROTARY] + [ROTARY] for names in stages]


def stage_modules(args: HFArgs, num_stages: int, split_points: Sequence[str]) -> list[list[str]]:
    with torch.device("meta"):
        model = HFCausalLM(args)
    return decoder_stages(model, num_stages, split_points)


def init_weights(module: nn.Module, seed: int) -> None:
    """Draws every parameter as transformers initialises these models (normal(0, initializer_range) matrices,
    zero biases, unit norm weights), each from (seed, its name) so that every layout starts equal, then computes
    the buffers."""
    config = module.config
    ndims = {canonical_fqn(name): param.ndim for name, param in module.named_parameters(remove_duplicate=False)}
    normal = functools.partial(nn.init.normal_, mean=0.0, std=config.initializer_range)

    def rule(name: str) -> ParamInit:
        key = EMBEDDING if name == HEAD and config.tie_word_embeddings else name
        if name.endswith(".bias"):
            return ParamInit(key, zeros)
        return ParamInit(key, normal if ndims[name] >= 2 else ones)

    init_parameters(module, seed, rule)
    init_buffers(module)


@torch.no_grad()
def init_buffers(module: nn.Module) -> None:
    """Recomputes the rotary embedding's inverse frequencies (non-persistent buffers, so no checkpoint holds
    them) by building the model's own rotary module on the CPU and copying its buffers."""
    for child in module.modules():
        if child.__class__.__name__.endswith("RotaryEmbedding"):
            fresh = type(child)(config=child.config)
            for name, value in fresh.named_buffers(recurse=False):
                getattr(child, name).copy_(value)


def flops_per_token(args: HFArgs, num_params: int, seq_len: int) -> int:
    """Training FLOPs per token, as for torchpre's Llama (`torchpre.models.llama3.args.flops_per_token`): 6 per
    parameter used in a matmul (the embedding lookup is not, unless tied to the output layer) plus attention's
    12 x layers x (heads x head_dim) x seq_len."""
    config = args.config
    lookup_params = 0 if args.tie_word_embeddings else args.vocab_size * args.dim
    head_dim = getattr(config, "head_dim", None) or args.dim // args.n_heads
    return 6 * (num_params - lookup_params) + 12 * args.n_layers * args.n_heads * head_dim * seq_len
