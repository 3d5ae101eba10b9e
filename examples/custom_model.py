"""A model torchpre has never seen, trained by train.py with every parallelism: a GPT-2-style decoder
(LayerNorm, learned positions, GELU MLP, biases, tied embeddings) and the one registry entry that
makes `--model.name gpt2` work with train.py, checkpoints and torchpre.generate.

    torchrun --nproc_per_node=2 train.py --job.custom_import examples.custom_model \\
        --model.name gpt2 --model.flavor tiny --parallelism.tensor_parallel_degree 2

`job.custom_import` imports this module before the job is checked, so the registration below runs first.
"""

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from torchpre.models.args import ArgsDefaults
from torchpre.models.init import ParamInit, init_parameters, ones
from torchpre.models.registry import ModelBuild, ModelSpec, ParallelPlans, register_model


@dataclasses.dataclass(frozen=True)
class GPT2Args(ArgsDefaults):
    """torchpre sets `vocab_size` (from the tokenizer) and `max_seq_len` (training.seq_len); the learned
    position table has its own size, `n_positions`."""

    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_positions: int = 1024
    vocab_size: int = 2048
    max_seq_len: int = 1024


class SelfAttention(nn.Module):
    def __init__(self, args: GPT2Args):
        super().__init__()
        self.head_dim = args.dim // args.n_heads
        self.q, self.k, self.v = (nn.Linear(args.dim, args.dim) for _ in range(3))
        self.proj = nn.Linear(args.dim, args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds some of them.
        q, k, v = (p(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, args: GPT2Args):
        super().__init__()
        self.fc, self.proj = nn.Linear(args.dim, 4 * args.dim), nn.Linear(4 * args.dim, args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, args: GPT2Args):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(args.dim), SelfAttention(args)
        self.ln_2, self.mlp = nn.LayerNorm(args.dim), MLP(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """Pipeline-ready: a stage without `wte` (None) takes hidden states, one without `lm_head` returns them."""

    def __init__(self, args: GPT2Args):
        super().__init__()
        self.args = args
        self.wte = nn.Embedding(args.vocab_size, args.dim)
        self.wpe = nn.Embedding(args.n_positions, args.dim)
        self.h = nn.ModuleDict({str(i): Block(args) for i in range(args.n_layers)})
        self.ln_f = nn.LayerNorm(args.dim)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.wte is not None:
            h = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        else:
            h = tokens
        for block in self.h.values():
            h = block(h)
        return self.lm_head(self.ln_f(h)) if self.lm_head is not None else h

    def init_weights(self, seed: int) -> None:
        """Each parameter from (seed, its name), so every layout starts from the same weights."""
        init_parameters(self, seed, gpt2_init_rule(self.args))


def _zeros(tensor: torch.Tensor, *, generator: torch.Generator) -> None:
    tensor.zero_()


def gpt2_init_rule(args: GPT2Args):
    def rule(fqn: str) -> ParamInit:
        if fqn in ("wte.weight", "lm_head.weight"):  # tied: one key, so both copies start equal
            return ParamInit("wte.weight", functools.partial(nn.init.normal_, std=0.02))
        if fqn.endswith("bias"):
            return ParamInit(fqn, _zeros)
        if ".ln_" in fqn or fqn.startswith("ln_f"):
            return ParamInit(fqn, ones)
        std = 0.02 / math.sqrt(2 * args.n_layers) if fqn.endswith("proj.weight") else 0.02
        return ParamInit(fqn, functools.partial(nn.init.normal_, std=std))

    return rule


# Megatron-style: q/k/v and fc split by output column, the projections back by row.
TP_PLAN = {
    "h.*.attn.q": ColwiseParallel(),
    "h.*.attn.k": ColwiseParallel(),
    "h.*.attn.v": ColwiseParallel(),
    "h.*.attn.proj": RowwiseParallel(),
    "h.*.mlp.fc": ColwiseParallel(),
    "h.*.mlp.proj": RowwiseParallel(),
}

SPEC = ModelSpec(
    build=ModelBuild(model_cls=GPT2, blocks="h", tied_weights=lambda args: ("wte.weight", "lm_head.weight")),
    flavors={"tiny": GPT2Args(), "124M": GPT2Args(dim=768, n_layers=12, n_heads=12)},
    parallel=ParallelPlans(tensor_parallel=TP_PLAN),
)

register_model("gpt2", SPEC)
