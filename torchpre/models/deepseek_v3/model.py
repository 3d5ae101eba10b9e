"""DeepSeek-V3 in plain PyTorch: the MoE family's decoder (routed and shared experts, DeepSeek-V3's routing, dense
first blocks) with multi-head latent attention (MLA) in every block.

MLA projects the input to a small latent from which every head's keys and values are expanded (`wkv_a` then
`wkv_b`), and the queries likewise through their own latent (`wq_a`, `wq_b`; or one `wq` without it). Each head's
query and key are a position-free part and a RoPE part; the keys' RoPE part comes straight from the input, one for
all heads. Queries and keys have `qk_nope_head_dim + qk_rope_head_dim` dimensions, values `v_head_dim`. RoPE rotates
adjacent pairs, as the released weights are laid out (Hugging Face's `rope_interleave = True`).

The softmax scale is 1/sqrt(query head size), times mscale^2 under YaRN: the queries are multiplied by that factor
over the kernels' own 1/sqrt(head size), so every attention kernel (flash, SDPA, flex, context parallelism's
gathered attention) computes the released scores unchanged.

Inference (`forward(..., start_pos=p)` after `setup_caches`) caches per position only what the heads' keys and
values are made from, as DeepSeek-V3's own inference does: the normalised kv latent and the rotated shared RoPE key,
kv_lora_rank + qk_rope_head_dim numbers (576 in the 671B model) instead of n_heads x (qk_head_dim + v_head_dim)
(40,960). See `LatentKVCache` and `MultiHeadLatentAttention._attend_latent`.

No parallelism lives here (see parallelize.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from functools import partial

import torch
from torch import Tensor, nn

from torchpre.models.attention import DocumentMask
from torchpre.models.aux_loss import AddAuxLoss
from torchpre.models.deepseek_v3.args import DeepSeekV3Args, YarnScaling
from torchpre.models.deepseek_v3.mtp import MTPDepth, MultiTokenPrediction
from torchpre.models.init import InitRule, ParamInit, ones
from torchpre.models.llama3.model import KVCache, TransformerBlock, apply_rope, attend, build_rope_cache
from torchpre.models.moe.model import MoE, MoEBlock, MoETransformer, local_shard
from torchpre.models.moe.model import init_rule as moe_init_rule


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale for a context stretched by `factor`."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(args: DeepSeekV3Args) -> float:
    """The released softmax scale: 1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under YaRN."""
    scale = args.qk_head_dim**-0.5
    if args.yarn is not None and args.yarn.mscale_all_dim:
        scale *= yarn_mscale(args.yarn.factor, args.yarn.mscale_all_dim) ** 2
    return scale


def _yarn_frequencies(dim: int, theta: float, yarn: YarnScaling, device: torch.device | str | None) -> Tensor:
    """The rotation frequencies of `dim` RoPE dimensions under YaRN, as transformers computes them (which the
    released model was trained with): extrapolated above `beta_fast` rotations over the original context,
    interpolated (divided by `factor`) below `beta_slow`, a linear ramp between."""

    def correction_dim(rotations: float) -> float:
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    extrapolated = 1 - ramp
    return 1.0 / (yarn.factor * base) * (1 - extrapolated) + 1.0 / base * extrapolated


def mla_rope_cache(args: DeepSeekV3Args, device: torch.device | str | None) -> Tensor:
    """The [max_seq_len, 2 * qk_rope_head_dim] table `apply_rope` reads, with YaRN's frequencies and cos/sin scale
    when `args.yarn` is set."""
    dim, theta = args.qk_rope_head_dim, args.rope_theta
    attention_factor = 1.0
    if args.yarn is None:
        freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    else:
        yarn = args.yarn
        freqs = _yarn_frequencies(dim, theta, yarn, device)
        if yarn.attention_factor is not None:
            attention_factor = yarn.attention_factor
        elif yarn.mscale and yarn.mscale_all_dim:
            attention_factor = yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim)
        else:
            attention_factor = yarn_mscale(yarn.factor)
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float32, device=device), freqs)
    return build_rope_cache(angles.cos() * attention_factor, angles.sin() * attention_factor)


class LatentKVCache(KVCache):
    """MLA's KV cache for one layer during inference: Llama 3's cache with the normalised kv latent [batch, max_len,
    kv_lora_rank] in its key slot and the rotated RoPE key all heads share [batch, max_len, qk_rope_head_dim] in its
    value slot (`update(start_pos, latent, rope_key)`). Under tensor parallelism every rank holds the whole cache:
    the latent is replicated (`wkv_a` is), only `wkv_b`'s heads are sharded.
    """

    @property
    def latent(self) -> Tensor | None:
        return self.k

    @property
    def rope_key(self) -> Tensor | None:
        return self.v


class MultiHeadLatentAttention(nn.Module):
    """Causal multi-head latent attention (see the module doc); forward takes Llama 3 `Attention`'s arguments."""

    kv_cache: LatentKVCache | None

    def __init__(self, args: DeepSeekV3Args) -> None:
        super().__init__()
        self.q_lora_rank, self.kv_lora_rank, self.v_head_dim = args.q_lora_rank, args.kv_lora_rank, args.v_head_dim
        self.qk_nope_head_dim, self.qk_rope_head_dim = args.qk_nope_head_dim, args.qk_rope_head_dim
        self.qk_head_dim = args.qk_head_dim
        if args.q_lora_rank == 0:
            self.wq = nn.Linear(args.dim, args.n_heads * args.qk_head_dim, bias=False)
        else:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(args.q_lora_rank, eps=args.latent_norm_eps)
            self.wq_b = nn.Linear(args.q_lora_rank, args.n_heads * args.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(args.kv_lora_rank, eps=args.latent_norm_eps)
        self.wkv_b = nn.Linear(args.kv_lora_rank, args.n_heads * (args.qk_nope_head_dim + args.v_head_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * args.v_head_dim, args.dim, bias=False)
        # Over the kernels' 1/sqrt(qk_head_dim): YaRN's mscale^2 and the parametrization's factor (µP's 1/d).
        self.query_scale = softmax_scale(args) * args.qk_head_dim**0.5 * args.parametrization.attention_multiplier
        self.kv_cache = None

    def forward(
        self,
        x: Tensor,
        rope_cache: Tensor,
        start_pos: int | None = None,
        doc_mask: DocumentMask | None = None,
    ) -> Tensor:
        """As Llama 3's `Attention.forward`: `rope_cache` starts at position 0 (or holds the rows of x's positions,
        under context parallelism's hook), `start_pos` reads and extends the KV cache, `doc_mask` keeps attention
        within documents (or is the attention itself)."""
        bsz, seqlen, _ = x.shape
        offset = 0 if start_pos is None else start_pos
        rope = rope_cache[offset : offset + seqlen]
        # -1 heads: under tensor parallelism each rank holds only its share of the heads.
        q = self.wq(x) if self.q_lora_rank == 0 else self.wq_b(self.q_norm(self.wq_a(x)))
        q_nope, q_rope = q.view(bsz, seqlen, -1, self.qk_head_dim).split(
            [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1
        )
        q_rope = apply_rope(q_rope, rope)
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        latent = self.kv_norm(latent)
        k_rope = apply_rope(k_rope.unsqueeze(2), rope)  # one RoPE key for every head
        if start_pos is not None:
            out = self._attend_latent(q_nope, q_rope, latent, k_rope.squeeze(2), start_pos)
        else:
            kv = self.wkv_b(latent).view(bsz, seqlen, -1, self.qk_nope_head_dim + self.v_head_dim)
            k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
            q = torch.cat((q_nope, q_rope), dim=-1)
            k = torch.cat((k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)), dim=-1)
            if self.query_scale != 1.0:
                q = q * self.query_scale
            out = attend(q, k, v, None, None, doc_mask)
        return self.wo(out.reshape(bsz, seqlen, -1))

    def _attend_latent(
        self, q_nope: Tensor, q_rope: Tensor, latent: Tensor, rope_key: Tensor, start_pos: int
    ) -> Tensor:
        """Inference: store this input's latent and RoPE key in the cache at start_pos.. and attend to every cached
        position up to each query's own, in the absorbed form, returning [batch, seq, heads, v_head_dim].

        Absorbed rather than expanded: expanding would run every cached position through `wkv_b` at every step
        (n_heads x (qk_nope_head_dim + v_head_dim) x kv_lora_rank multiply-adds per position per step). Instead
        `wkv_b`'s key rows fold into the query (q_nope W_uk, once per query) and its value rows into the output (once
        per query): scores = (q_nope W_uk) . latent + q_rope . rope_key, out = (probs . latent) W_uv^T, so the cached
        positions cost kv_lora_rank + qk_rope_head_dim per head for the scores and kv_lora_rank for the sum. The
        same path serves the prefill (start_pos 0), so what decoding reads is what it wrote. Under tensor
        parallelism `wkv_b`'s weight holds this rank's heads, which match its queries'.
        """
        if self.kv_cache is None:
            raise RuntimeError("start_pos needs a KV cache: call setup_caches() on the model first")
        latent, rope_key = self.kv_cache.update(start_pos, latent, rope_key)
        w_uk, w_uv = (
            local_shard(self.wkv_b.weight)
            .view(-1, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
            .split([self.qk_nope_head_dim, self.v_head_dim], dim=1)
        )
        q_latent = torch.einsum("bshn,hnr->bshr", q_nope, w_uk)
        scores = torch.einsum("bshr,btr->bhst", q_latent, latent) + torch.einsum("bshd,btd->bhst", q_rope, rope_key)
        scores = scores * (self.query_scale * self.qk_head_dim**-0.5)
        seqlen = q_nope.shape[1]
        if seqlen > 1:  # query i sits at position start_pos + i and sees keys 0 .. start_pos + i
            visible = torch.ones(seqlen, start_pos + seqlen, dtype=torch.bool, device=scores.device)
            scores = scores.masked_fill(~visible.tril(diagonal=start_pos), float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).type_as(latent)
        return torch.einsum("bshr,hvr->bshv", torch.einsum("bhst,btr->bshr", probs, latent), w_uv)


class DenseMLABlock(TransformerBlock):
    """A dense first block: MLA, then a SwiGLU feed-forward of width `dense_hidden_dim`."""

    def build_attention(self, args: DeepSeekV3Args) -> MultiHeadLatentAttention:
        return MultiHeadLatentAttention(args)


class MoEMLABlock(MoEBlock):
    """MLA, then the MoE layer (routed experts plus the shared expert)."""

    def build_attention(self, args: DeepSeekV3Args) -> MultiHeadLatentAttention:
        return MultiHeadLatentAttention(args)


def mtp_block_path(depth: int) -> str:
    """The dotted path of multi-token prediction depth `depth`'s block (1-based, as `MultiTokenPrediction.depths`)."""
    return f"mtp.depths.{depth}.block"


def mtp_blocks(args: DeepSeekV3Args) -> tuple[str, ...]:
    """The multi-token prediction blocks' paths: units of activation checkpointing, compile and FSDP like the layers
    (`ModelSpec.build.extra_blocks`)."""
    return tuple(mtp_block_path(depth) for depth in range(1, args.mtp_depth + 1))


class DeepSeekV3Transformer(MoETransformer):
    """DeepSeek-V3 decoder: tokens [batch, seq] -> logits [batch, seq, vocab]. The MoE family's `MoETransformer`
    (routing, balancing biases, statistics, pipeline-stage behaviour) with MLA blocks and their latent KV caches,
    the RoPE table of the queries' and keys' RoPE part, MLA's init rule and, with `mtp_depth`, multi-token
    prediction (mtp.py).

    `mtp` and `mtp_embeddings` come after the output layer, so a pipeline split puts them on the last stage;
    `mtp_embeddings` is the embedding's second name (`ModelSpec.build.tied_weights`): one Parameter where one part holds
    both, two copies with summed gradients where the first and last stages do."""

    args: DeepSeekV3Args
    moe_block = MoEMLABlock
    dense_block = DenseMLABlock
    mtp: MultiTokenPrediction | None
    mtp_embeddings: nn.Embedding | None

    def __init__(self, args: DeepSeekV3Args) -> None:
        super().__init__(args)
        self.mtp, self.mtp_embeddings = None, None
        if args.mtp_depth:
            block = self.moe_block if args.mtp_block_is_moe else self.dense_block
            depths = [MTPDepth(args.dim, args.norm_eps, block(args)) for _ in range(args.mtp_depth)]
            self.mtp = MultiTokenPrediction(depths, args.mtp_loss_weight, args.parametrization.logit_multiplier)
            self.mtp_embeddings = nn.Embedding(args.vocab_size, args.dim)
            self.tie_weights()

    def tie_weights(self) -> None:
        """Llama 3's ties, and the multi-token prediction's embedding as the embedding where one part holds both."""
        super().tie_weights()
        if getattr(self, "mtp_embeddings", None) is not None and self.tok_embeddings is not None:
            self.mtp_embeddings.weight = self.tok_embeddings.weight

    def forward(
        self,
        tokens: Tensor,
        start_pos: int | None = None,
        document_ids: Tensor | None = None,
        doc_mask: DocumentMask | None = None,
        future_tokens: Tensor | None = None,
    ) -> Tensor:
        """Llama 3's forward; with `future_tokens` (`mtp.future_tokens` of these positions, training only) on the
        part holding the multi-token prediction, its loss joins the gradient (`AddAuxLoss`), the logits unchanged."""
        if future_tokens is None or self.mtp is None or not self.mtp.depths or not torch.is_grad_enabled():
            return super().forward(tokens, start_pos, document_ids, doc_mask)
        doc_mask = self.checked_mask(tokens, start_pos, document_ids, doc_mask)
        h = self.blocks(tokens, start_pos, doc_mask)
        # The embedding module itself where this part holds it: its parallel plan, not only its weight, is there.
        embedding = self.tok_embeddings if self.tok_embeddings is not None else self.mtp_embeddings
        mtp_loss = self.mtp(h, future_tokens, partial(self.embed, embedding), self.output, self.rope_cache, doc_mask)
        return self.head(AddAuxLoss.apply(h, mtp_loss))

    def set_token_loss_scale(self, scale: float | None) -> None:
        """The multi-token prediction's 1 / the step's token count (`ModelSpec.hooks.set_token_loss_scale`)."""
        if self.mtp is not None:
            self.mtp.loss_scale = scale

    def attention_blocks(self) -> Iterator[tuple[str, nn.Module]]:
        """The layers, then each multi-token prediction depth's block."""
        yield from super().attention_blocks()
        if self.mtp is not None:
            for depth, module in self.mtp.depths.items():
                yield mtp_block_path(int(depth)), module.block

    def moe_layers_by_id(self) -> Iterator[tuple[int, MoE]]:
        """The main blocks' MoE layers, then each multi-token prediction depth's as row n_layers + depth - 1 (through
        any activation-checkpoint wrapper around its block)."""
        yield from super().moe_layers_by_id()
        if self.mtp is not None:
            for depth, module in self.mtp.depths.items():
                for layer in module.block.modules():
                    if isinstance(layer, MoE):
                        yield self.args.n_layers + int(depth) - 1, layer

    @torch.no_grad()
    def init_buffers(self) -> None:
        super().init_buffers()
        if self.mtp is not None:
            self.mtp.reset_stats()

    def _rope_cache(self, device: torch.device | str | None) -> Tensor:
        return mla_rope_cache(self.args, device)

    def setup_caches(self, batch_size: int, max_len: int) -> None:
        """Give each MLA layer this model (or stage) holds a fresh `LatentKVCache` (Llama 3's `setup_caches` with
        MLA's cache: `clear_caches` and generation's calls stay as they are)."""
        for layer in self.layers.values():
            layer.attention.kv_cache = LatentKVCache(batch_size, max_len)

    def param_init_rule(self, args: DeepSeekV3Args | None = None) -> InitRule:
        return init_rule(args or self.args)

    def vocabulary_parameters(self) -> set[str]:
        return super().vocabulary_parameters() | {"mtp_embeddings.weight"}


def init_rule(args: DeepSeekV3Args) -> InitRule:
    """The MoE family's init for the names the models share; MLA's projections as Llama 3's attention's (std 0.02,
    the output projection shrinking with depth), its latent norms at 1. The generator key is each name."""
    moe_rule = moe_init_rule(args)
    projection = partial(nn.init.trunc_normal_, std=0.02)

    def rule(fqn: str) -> ParamInit:
        match fqn.split("."):
            case ["mtp_embeddings", "weight"]:
                return moe_rule("tok_embeddings.weight")  # the embedding's second name starts equal to it
            case ["mtp", "depths", depth, "block", *rest]:  # a block as the layer after the last
                return ParamInit(fqn, rule(".".join(["layers", str(args.n_layers + int(depth) - 1), *rest])).fill)
            case ["mtp", "depths", _, "embedding_norm" | "hidden_norm" | "norm", "weight"]:
                return ParamInit(fqn, ones)
            case ["mtp", "depths", _, "projection", "weight"]:
                return ParamInit(fqn, projection)
            case ["layers", _, "attention", "wq" | "wq_a" | "wq_b" | "wkv_a" | "wkv_b", "weight"]:
                return ParamInit(fqn, projection)
            case ["layers", _, "attention", "q_norm" | "kv_norm", "weight"]:
                return ParamInit(fqn, ones)
            case ["layers", layer_id, "attention", "wo", "weight"]:
                return ParamInit(fqn, partial(nn.init.trunc_normal_, std=0.02 / math.sqrt(2 * (int(layer_id) + 1))))
        try:
            return moe_rule(fqn)
        except KeyError:
            raise KeyError(f"no DeepSeek-V3 init rule for parameter {fqn!r}") from None

    return rule
