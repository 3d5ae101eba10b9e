"""Llama 3 in plain PyTorch.

No parallelism lives here. Tensor parallelism shards the linear layers from outside, which is
why attention reads its local head count from the projected shapes; pipeline parallelism
deletes layers and sets `tok_embeddings`, `norm` or `output` to None, which is why `layers` is
a ModuleDict keyed by layer index and `forward` skips missing parts.

Inference: `setup_caches(batch_size, max_len)` gives every attention layer a `KVCache`, and
`forward(tokens, start_pos=p)` then processes positions p, p+1, ... against the cached keys and
values (prefill with p = 0, then one token at a time). Training never passes `start_pos`.

Packed training sequences: `forward(tokens, document_ids=d)` keeps attention inside each document
(d [batch, seq] numbers the documents along each row); RoPE positions stay those of the packed row.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchpre.models.attention import (
    DocumentMask,
    causal_attention,
    document_causal_attention,
    document_mask,
    sdpa,
)
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


def build_rope_cache(cos: Tensor, sin: Tensor) -> Tensor:
    """The [seq, 2 * head_dim] table `apply_rope` reads: each pair's cos for both members of the pair,
    then its sin signed as the rotation uses it (-sin for the even member, +sin for the odd)."""
    return torch.cat((cos.repeat_interleave(2, dim=-1), torch.stack((-sin, sin), dim=-1).flatten(-2)), dim=-1)


def apply_rope(x: Tensor, cache: Tensor) -> Tensor:
    """Rotate each pair (x[..., 2i], x[..., 2i+1]) by its angle, in float32 real arithmetic
    (Meta's interleaved layout; no complex numbers, so DTensor, compile and bf16 all work).

    As x * cos + swap_pairs(x) * signed_sin: two multiplies and one copy, about half the work of
    rotating the even and odd halves separately and stacking them.

    x: [batch, seq, heads, head_dim]; cache: [seq, 2 * head_dim] from `build_rope_cache`.
    """
    cos, signed_sin = cache[:, None, :].chunk(2, dim=-1)
    x32 = x.float()
    swapped = x32.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return (x32 * cos + swapped * signed_sin).type_as(x)


class KVCache(nn.Module):
    """Keys and values of the positions seen so far, for one attention layer during inference.

    The buffers [batch_size, max_len, kv_heads, head_dim] are allocated on the first `update`,
    with the head count, dtype and device of the keys it receives: under tensor parallelism that
    is this rank's share of the heads, which the model itself never needs to know. They are not
    part of the state dict.
    """

    k: Tensor | None
    v: Tensor | None

    def __init__(self, batch_size: int, max_len: int) -> None:
        super().__init__()
        self.batch_size, self.max_len = batch_size, max_len
        self.register_buffer("k", None, persistent=False)
        self.register_buffer("v", None, persistent=False)

    def update(self, start_pos: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Stores k, v [batch, seq, ...] (heads x head_dim; MLA's latent and RoPE key) at positions start_pos..
        and returns the keys and values of positions 0 .. start_pos + seq - 1."""
        bsz, seqlen = k.shape[:2]
        end = start_pos + seqlen
        if bsz > self.batch_size or end > self.max_len:
            raise ValueError(
                f"KV cache of batch {self.batch_size} x {self.max_len} positions cannot hold "
                f"batch {bsz} at positions {start_pos}..{end - 1}"
            )
        if self.k is None:  # keys and values may differ in head size (multi-head latent attention)
            self.k = k.new_zeros(self.batch_size, self.max_len, *k.shape[2:])
            self.v = v.new_zeros(self.batch_size, self.max_len, *v.shape[2:])
        self.k[:bsz, start_pos:end] = k
        self.v[:bsz, start_pos:end] = v
        return self.k[:bsz, :end], self.v[:bsz, :end]


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary position embeddings.

    `query_multiplier` scales the queries, so the softmax sees the scores times query_multiplier / sqrt(head_dim)
    whichever kernel runs (µP's 1/head_dim scale, `torchpre.models.parametrization`); 1 computes nothing."""

    kv_cache: KVCache | None

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, query_multiplier: float = 1.0) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        self.query_multiplier = query_multiplier
        self.kv_cache = None

    def forward(
        self,
        x: Tensor,
        rope_cache: Tensor,
        start_pos: int | None = None,
        doc_mask: DocumentMask | None = None,
    ) -> Tensor:
        """`rope_cache` starts at position 0 and covers at least the sequence; it is cut here,
        where the sequence is whole (under sequence parallelism the residual stream outside
        attention holds only a slice).

        With `start_pos` (inference; needs `kv_cache`), x holds positions start_pos.. and attends
        causally to those and to the cached earlier ones. With `doc_mask` (training on packed
        documents), attention stays within each document; the mask covers the whole sequence, as
        x does here. Both must be passed by keyword: the tensor-parallel plan prepares only the
        positional inputs.
        """
        bsz, seqlen, _ = x.shape
        offset = 0 if start_pos is None else start_pos
        rope_cache = rope_cache[offset : offset + seqlen]
        # -1 heads: under tensor parallelism each rank holds only its share of the heads.
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = apply_rope(q, rope_cache), apply_rope(k, rope_cache)
        if self.query_multiplier != 1.0:
            q = q * self.query_multiplier
        out = attend(q, k, v, self.kv_cache, start_pos, doc_mask)
        return self.wo(out.reshape(bsz, seqlen, -1))


def attend(
    q: Tensor, k: Tensor, v: Tensor, kv_cache: KVCache | None, start_pos: int | None, doc_mask: DocumentMask | None
) -> Tensor:
    """Causal attention of q, k, v [batch, seq, heads, head_dim] as an attention layer's `forward` asks for it:
    against its KV cache from `start_pos` (inference), within documents (`doc_mask`), or plain causal."""
    if start_pos is not None:
        return _attend_with_cache(q, k, v, kv_cache, start_pos)
    if doc_mask is not None:
        return document_causal_attention(q, k, v, doc_mask)
    return causal_attention(q, k, v)


def _attend_with_cache(q: Tensor, k: Tensor, v: Tensor, kv_cache: KVCache | None, start_pos: int) -> Tensor:
    """Inference: store k, v at positions start_pos.. and attend to every cached position up to
    each query's own."""
    if kv_cache is None:
        raise RuntimeError("start_pos needs a KV cache: call setup_caches() on the model first")
    k, v = kv_cache.update(start_pos, k, v)
    seqlen = q.shape[1]
    if start_pos == 0:
        return sdpa(q, k, v, mask=None, is_causal=True)
    # Query i sits at position start_pos + i and sees keys 0 .. start_pos + i.
    mask = None
    if seqlen > 1:
        mask = torch.ones(seqlen, start_pos + seqlen, dtype=torch.bool, device=q.device).tril(diagonal=start_pos)
    return sdpa(q, k, v, mask=mask, is_causal=False)


class SiluGate(nn.Module):
    """SwiGLU's activation: silu(gate) * up, a module of its own so that activation_checkpoint.recompute_mlp_activation
    can change what it keeps for backward (`torchpre.parallel.mlp_activation`)."""

    def forward(self, gate: Tensor, up: Tensor) -> Tensor:
        return F.silu(gate) * up


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.activation = SiluGate()

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(self.activation(self.w1(x), self.w3(x)))


class GeluFeedForward(nn.Module):
    """GPT's non-gated MLP: w2(gelu(w1 x)), exact GELU or (`approximate="tanh"`) GPT-2's tanh form.

    The names w1 and w2 are SwiGLU's, so tensor parallelism, initialisation and µP treat both MLPs alike; no biases,
    as in the rest of the model."""

    def __init__(self, dim: int, hidden_dim: int, approximate: str = "none") -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.activation = nn.GELU(approximate=approximate)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(self.activation(self.w1(x)))


def build_mlp(args: TransformerArgs) -> nn.Module:
    """The dense feed-forward model.mlp asks for, of width `args.ffn_hidden_dim`."""
    if args.mlp == "swiglu":
        return FeedForward(args.dim, args.ffn_hidden_dim)
    return GeluFeedForward(args.dim, args.ffn_hidden_dim, approximate="tanh" if args.mlp == "gelu_tanh" else "none")


class TransformerBlock(nn.Module):
    """Pre-norm residual block: attention, then feed-forward.

    A family with another feed-forward (routed experts, say) subclasses it and overrides `build_ffn` and
    `ffn_name`, the feed-forward's attribute and so the prefix of its parameters' names; one with another
    attention overrides `build_attention` (its module takes Attention's forward arguments).
    Each branch's output is multiplied by `residual_multiplier` before it joins the residual stream (CompleteP's
    1 / depth multiplier; 1 computes nothing).
    """

    ffn_name = "feed_forward"

    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = self.build_attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.add_module(self.ffn_name, self.build_ffn(args))
        self.residual_multiplier = args.parametrization.residual_multiplier

    def build_attention(self, args: TransformerArgs) -> nn.Module:
        return Attention(args.dim, args.n_heads, args.n_kv_heads, args.parametrization.attention_multiplier)

    def build_ffn(self, args: TransformerArgs) -> nn.Module:
        return build_mlp(args)

    def forward(
        self,
        x: Tensor,
        rope_cache: Tensor,
        start_pos: int | None = None,
        doc_mask: DocumentMask | None = None,
    ) -> Tensor:
        h = x + self.branch(self.attention(self.attention_norm(x), rope_cache, start_pos=start_pos, doc_mask=doc_mask))
        return h + self.branch(getattr(self, self.ffn_name)(self.ffn_norm(h)))

    def branch(self, out: Tensor) -> Tensor:
        """A residual branch's output as it joins the residual stream."""
        return out if self.residual_multiplier == 1.0 else out * self.residual_multiplier


class Transformer(nn.Module):
    """Llama 3 decoder: tokens [batch, seq] -> logits [batch, seq, vocab].

    A pipeline stage may set `tok_embeddings` to None (it then takes hidden states), set `norm`
    and `output` to None (it then returns hidden states), and delete entries of `layers`.

    A family built on it passes its own `block` class (see `TransformerBlock`) and overrides
    `param_init_rule(args=None)` (a parametrization asks it for its base model's rule).
    """

    tok_embeddings: nn.Embedding | None
    norm: nn.RMSNorm | None
    output: nn.Linear | None
    rope_cache: Tensor

    def __init__(self, args: TransformerArgs, block: Callable[[TransformerArgs], nn.Module] = TransformerBlock) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): block(args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("rope_cache", self._rope_cache(device=None), persistent=False)
        self.tie_weights()

    def _rope_cache(self, device: torch.device | str | None) -> Tensor:
        args = self.args
        cos, sin = precompute_rope(args.head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling, device)
        return build_rope_cache(cos, sin)

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
        """Re-tie embeddings, initialize every parameter from (seed, its name) as the family's rule scaled by the
        parametrization says, and recompute the RoPE cache. The result does not depend on device, dtype, sharding
        or stage split."""
        self.tie_weights()
        init_parameters(self, seed, self.args.parametrization.init_rule(self.param_init_rule))
        self.init_buffers()

    def param_init_rule(self, args: TransformerArgs | None = None) -> InitRule:
        """Each parameter's initialisation in the standard parametrization, by name (`init_rule`), of this model or
        of the model `args` describe (a parametrization's base model)."""
        return init_rule(args or self.args)

    def vocabulary_parameters(self) -> set[str]:
        """The names of the matrices with a row per token: the embedding and the output layer (a parametrization
        scales them unlike the hidden matrices)."""
        return {"tok_embeddings.weight", "output.weight"}

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Recompute the RoPE cache, e.g. after `to_empty` when the weights come from a checkpoint. On meta (a dry
        run, the planner's probes) only its shape exists: the table is not computed (at 405B's 131,072 positions,
        0.3 s a build)."""
        self.rope_cache.copy_(self._rope_cache(device="meta" if self.rope_cache.is_meta else "cpu"))

    def setup_caches(self, batch_size: int, max_len: int) -> None:
        """Give each attention layer this model (or stage) holds a fresh KV cache for up to
        `batch_size` sequences of `max_len` positions, for `forward(..., start_pos=...)`."""
        for layer in self.layers.values():
            layer.attention.kv_cache = KVCache(batch_size, max_len)

    def attention_blocks(self) -> Iterator[tuple[str, nn.Module]]:
        """(path, block) of each block this model (or stage) holds: its layers, then any blocks a family adds
        (DeepSeek-V3's multi-token prediction), which tensor and context parallelism shard alike."""
        for layer_id, block in self.layers.items():
            yield f"layers.{layer_id}", block

    def clear_caches(self) -> None:
        """Drop the KV caches (and their memory)."""
        for layer in self.layers.values():
            layer.attention.kv_cache = None

    def forward(
        self,
        tokens: Tensor,
        start_pos: int | None = None,
        document_ids: Tensor | None = None,
        doc_mask: DocumentMask | None = None,
    ) -> Tensor:
        """Token ids [batch, seq] to logits; a pipeline stage maps hidden states to hidden states.

        `start_pos` (inference only, after `setup_caches`) is the position of the first input
        token: the layers read and extend their KV caches, and RoPE starts at that position.
        `document_ids` (training only) [batch, seq] gives each position's document: a position
        attends only to earlier positions of its own document. The mask is built once here and
        shared by every layer. `doc_mask` instead: a document mask (or an attention that owns it)
        built by the caller, for layers whose attention is not over this input's positions alone
        (context parallelism's hook builds one from the whole sequence's document ids).
        """
        doc_mask = self.checked_mask(tokens, start_pos, document_ids, doc_mask)
        return self.head(self.blocks(tokens, start_pos, doc_mask))

    def checked_mask(
        self, tokens: Tensor, start_pos: int | None, document_ids: Tensor | None, doc_mask: DocumentMask | None
    ) -> DocumentMask | None:
        """`forward`'s arguments checked, and the document mask the blocks get (built from `document_ids`)."""
        seqlen, max_seq_len = tokens.shape[1], self.rope_cache.shape[0]
        end = seqlen + (start_pos or 0)
        if end > max_seq_len:
            raise ValueError(f"sequence length {end} exceeds max_seq_len {max_seq_len}")
        if start_pos is not None and (document_ids is not None or doc_mask is not None):
            raise ValueError("document_ids is for training on packed sequences; it cannot be combined with start_pos")
        if document_ids is not None and doc_mask is not None:
            raise ValueError("pass document_ids or a doc_mask built from them, not both")
        return document_mask(document_ids) if document_ids is not None else doc_mask

    def blocks(self, tokens: Tensor, start_pos: int | None, doc_mask: DocumentMask | None) -> Tensor:
        """The embedding (on the stage holding it) and the blocks: the hidden states before the final norm."""
        h = self.embed(self.tok_embeddings, tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope_cache, start_pos=start_pos, doc_mask=doc_mask)
        return h

    def head(self, h: Tensor) -> Tensor:
        """The final norm and the output layer (on the stage holding them) of the last block's hidden states."""
        h = self.norm(h) if self.norm is not None else h
        return self.logits(h) if self.output is not None else h

    def embed(self, embedding: nn.Module, tokens: Tensor) -> Tensor:
        """`embedding` (this model's, or its copy on another stage) of `tokens`, times the embedding multiplier."""
        multiplier = self.args.parametrization.embedding_multiplier
        return embedding(tokens) if multiplier == 1.0 else embedding(tokens) * multiplier

    def logits(self, h: Tensor) -> Tensor:
        """The output layer of normalised hidden states, times the logit multiplier."""
        multiplier = self.args.parametrization.logit_multiplier
        return self.output(h) if multiplier == 1.0 else self.output(h) * multiplier


def init_rule(args: TransformerArgs) -> InitRule:
    """torchtitan's Llama init. Projections into the residual stream (wo, w2, w3) shrink with
    depth so deep stacks start stable; the output layer is scaled to the model width. A GELU MLP's w1 and w2 take
    SwiGLU's rules for them (GPT-2 also shrinks its residual projections with depth).

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
