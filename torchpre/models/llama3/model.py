"""Llama 3 in plain PyTorch.

No parallelism lives here. Tensor parallelism shards the linear layers from outside, which is
why attention reads its local head count from the projected shapes; pipeline parallelism
deletes layers and sets `tok_embeddings`, `norm` or `output` to None, which is why `layers` is
a ModuleDict keyed by layer index and `forward` skips missing parts.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchpre.models.init import InitRule, ParamInit, init_parameters, ones
from torchpre.models.llama3.args import RopeScaling, TransformerArgs


def scale_rope_frequencies(freqs: Tensor, scaling: RopeScaling) -> Tensor:
    """Llama 3.1 scaling: divide low frequencies by `factor`, keep high ones, and interpolate
    smoothly between them (Meta's `apply_scaling`)."""
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / freqs
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    interpolated = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / scaling.factor, interpolated)
    return torch.where(wavelen < high_freq_wavelen, freqs, scaled)


def precompute_rope(
    head_dim: int,
    max_seq_len: int,
    theta: float,
    scaling: RopeScaling | None = None,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """cos and sin of `position * freq_i`, each float32 of shape [max_seq_len, head_dim // 2]."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    freqs = 1.0 / theta**exponents
    if scaling is not None:
        freqs = scale_rope_frequencies(freqs, scaling)
    positions = torch.arange(max_seq_len, dtype=torch.float32, device=device)
    angles = torch.outer(positions, freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, rope_cache: Tensor) -> Tensor:
    """Rotate each pair (x[..., 2i], x[..., 2i+1]) by its angle, in float32 real arithmetic
    (Meta's interleaved layout; no complex numbers, so DTensor, compile and bf16 all work).

    x: [batch, seq, heads, head_dim]; rope_cache: [seq, head_dim], cos then sin halves.
    """
    cos, sin = rope_cache[:, None, :].chunk(2, dim=-1)
    even, odd = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary position embeddings."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: Tensor, rope_cache: Tensor) -> Tensor:
        """`rope_cache` covers at least the sequence; it is cut here, where the sequence is whole
        (under sequence parallelism the residual stream outside attention holds only a slice)."""
        bsz, seqlen, _ = x.shape
        rope_cache = rope_cache[:seqlen]
        # -1 heads: under tensor parallelism each rank holds only its share of the heads.
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = apply_rope(q, rope_cache), apply_rope(k, rope_cache)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: attention, then feed-forward."""

    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args.dim, args.n_heads, args.n_kv_heads)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)

    def forward(self, x: Tensor, rope_cache: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cache)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Llama 3 decoder: tokens [batch, seq] -> logits [batch, seq, vocab].

    A pipeline stage may set `tok_embeddings` to None (it then takes hidden states), set `norm`
    and `output` to None (it then returns hidden states), and delete entries of `layers`.
    """

    tok_embeddings: nn.Embedding | None
    norm: nn.RMSNorm | None
    output: nn.Linear | None
    rope_cache: Tensor

    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("rope_cache", self._rope_cache(device=None), persistent=False)
        self.tie_weights()

    def _rope_cache(self, device: torch.device | str | None) -> Tensor:
        args = self.args
        cos, sin = precompute_rope(
            args.head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling, device
        )
        return torch.cat((cos, sin), dim=-1)

    def tie_weights(self) -> None:
        """Make `output.weight` the embedding Parameter when tied and both are on this stage.

        `to_empty` and `parallelize_module` create new Parameters per module and so untie them;
        `init_weights` calls this again.
        """
        both_here = self.tok_embeddings is not None and self.output is not None
        if self.args.tie_word_embeddings and both_here:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Re-tie embeddings, initialize every parameter from (seed, its name), and recompute
        the RoPE cache. The result does not depend on device, dtype, sharding or stage split."""
        self.tie_weights()
        init_parameters(self, seed, init_rule(self.args))
        self.rope_cache.copy_(self._rope_cache(device="cpu"))

    def forward(self, tokens: Tensor) -> Tensor:
        """Token ids [batch, seq] to logits; a pipeline stage maps hidden states to hidden states."""
        seqlen, max_seq_len = tokens.shape[1], self.rope_cache.shape[0]
        if seqlen > max_seq_len:
            raise ValueError(f"sequence length {seqlen} exceeds max_seq_len {max_seq_len}")
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope_cache)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def init_rule(args: TransformerArgs) -> InitRule:
    """torchtitan's Llama init. Projections into the residual stream (wo, w2, w3) shrink with
    depth so deep stacks start stable; the output layer is scaled to the model width.

    With tied embeddings the shared table uses std 0.02 because it also produces the logits,
    and `output.weight` maps to the embedding's key and fill, so a pipeline stage holding its own
    copy starts equal to the stage holding `tok_embeddings`.
    """
    embedding = ParamInit(
        "tok_embeddings.weight",
        partial(nn.init.normal_, std=0.02 if args.tie_word_embeddings else 1.0),
    )
    output_std = args.dim**-0.5
    output = ParamInit(
        "output.weight",
        partial(nn.init.trunc_normal_, std=output_std, a=-3 * output_std, b=3 * output_std),
    )

    def rule(fqn: str) -> ParamInit:
        match fqn.split("."):
            case ["tok_embeddings", "weight"]:
                return embedding
            case ["output", "weight"]:
                return embedding if args.tie_word_embeddings else output
            case ["norm", "weight"] | ["layers", _, "attention_norm" | "ffn_norm", "weight"]:
                return ParamInit(fqn, ones)
            case ["layers", _, "attention", "wq" | "wk" | "wv", "weight"] | [
                "layers", _, "feed_forward", "w1", "weight"
            ]:
                return ParamInit(fqn, partial(nn.init.trunc_normal_, std=0.02))
            case ["layers", layer_id, "attention", "wo", "weight"] | [
                "layers", layer_id, "feed_forward", "w2" | "w3", "weight"
            ]:
                std = 0.02 / math.sqrt(2 * (int(layer_id) + 1))
                return ParamInit(fqn, partial(nn.init.trunc_normal_, std=std))
        raise KeyError(f"no Llama 3 init rule for parameter {fqn!r}")

    return rule
