"""A GPT-2-style decoder that torchpre has never seen, defined only in the tests: LayerNorm, learned position
embeddings, GELU MLP, biases (column-parallel biases are 1-D tensors that tensor parallelism shards) and tied
embeddings. `SPEC` registers it through the public API as a user's own model would be
(`register_model("gpt2-test", SPEC)`).
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
from torchpre.models.registry import HFAdapter, ModelBuild, ModelSpec, ParallelPlans

NAME = "gpt2-test"


@dataclasses.dataclass(frozen=True)
class GPT2Args(ArgsDefaults):
    """`vocab_size` and `max_seq_len` are set by torchpre (tokenizer, sequence length); the learned position
    table has its own fixed size, `n_positions`, so checkpoints fit whatever the sequence length."""

    dim: int = 32
    n_layers: int = 4
    n_heads: int = 4
    n_positions: int = 64
    vocab_size: int = 2048
    max_seq_len: int = 64


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
    """Pipeline-ready: a stage without `wte` takes hidden states, one without `lm_head` returns them."""

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
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            h = self.wte(tokens) + self.wpe(positions)
        else:
            h = tokens
        for block in self.h.values():
            h = block(h)
        return self.lm_head(self.ln_f(h)) if self.lm_head is not None else h

    def init_weights(self, seed: int) -> None:
        init_parameters(self, seed, gpt2_init_rule(self.args))


def zeros(tensor: torch.Tensor, *, generator: torch.Generator) -> None:
    tensor.zero_()


def gpt2_init_rule(args: GPT2Args):
    def rule(fqn: str) -> ParamInit:
        if fqn in ("wte.weight", "lm_head.weight"):  # tied: one key, so both copies start equal
            return ParamInit("wte.weight", functools.partial(nn.init.normal_, std=0.02))
        if fqn.endswith("bias"):
            return ParamInit(fqn, zeros)
        if ".ln_" in fqn or fqn.startswith("ln_f"):
            return ParamInit(fqn, ones)
        std = 0.02 / math.sqrt(2 * args.n_layers) if fqn.endswith("proj.weight") else 0.02
        return ParamInit(fqn, functools.partial(nn.init.normal_, std=std))

    return rule


TP_PLAN = {
    "h.*.attn.q": ColwiseParallel(),
    "h.*.attn.k": ColwiseParallel(),
    "h.*.attn.v": ColwiseParallel(),
    "h.*.attn.proj": RowwiseParallel(),
    "h.*.mlp.fc": ColwiseParallel(),
    "h.*.mlp.proj": RowwiseParallel(),
}

def to_hf(state_dict: dict[str, torch.Tensor], args: GPT2Args) -> dict[str, torch.Tensor]:
    """-> transformers' GPT2LMHeadModel names: fused qkv, Conv1D weights stored [in, out], lm_head tied."""
    hf = {f"transformer.{name}": state_dict[name] for name in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias")}
    for i in range(args.n_layers):
        ours, theirs = f"h.{i}", f"transformer.h.{i}"
        for kind in ("weight", "bias"):
            for norm in ("ln_1", "ln_2"):
                hf[f"{theirs}.{norm}.{kind}"] = state_dict[f"{ours}.{norm}.{kind}"]
            qkv = torch.cat([state_dict[f"{ours}.attn.{p}.{kind}"] for p in "qkv"])
            pairs = [
                ("attn.c_attn", qkv),
                ("attn.c_proj", state_dict[f"{ours}.attn.proj.{kind}"]),
                ("mlp.c_fc", state_dict[f"{ours}.mlp.fc.{kind}"]),
                ("mlp.c_proj", state_dict[f"{ours}.mlp.proj.{kind}"]),
            ]
            for name, tensor in pairs:
                hf[f"{theirs}.{name}.{kind}"] = tensor.t().contiguous() if kind == "weight" else tensor
    return hf


def hf_config(args: GPT2Args, *, bos_token_id: int, eos_token_id: int, torch_dtype: str, max_position_embeddings: int):
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": args.dim, "n_layer": args.n_layers,
        "n_head": args.n_heads, "n_positions": args.n_positions, "vocab_size": args.vocab_size,
        "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "torch_dtype": torch_dtype,
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
    }


def unsupported(*args):
    raise NotImplementedError("this test model converts to Hugging Face only")


SPEC = ModelSpec(
    build=ModelBuild(
        model_cls=GPT2,
        blocks="h",
        tied_weights=lambda args: ("wte.weight", "lm_head.weight"),
        sublayers=("attn", "mlp"),
    ),
    flavors={"tiny": GPT2Args()},
    parallel=ParallelPlans(tensor_parallel=TP_PLAN),
    hf=HFAdapter(to_hf_state_dict=to_hf, from_hf_state_dict=unsupported, hf_config=hf_config,
                 hf_config_mismatches=unsupported),
)
