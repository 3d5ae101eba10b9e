"""Multi-token prediction (MTP, DeepSeek-V3 section 2.2): `mtp_depth` modules after the main model, depth k
predicting the token k + 1 positions after each position, trained through a loss added to the gradient.

Depth k (1..D) at position i joins the previous depth's hidden state there (for k = 1 the main model's last block
output, before its final norm) with the embedding of the token k positions ahead, t(i+k):

    h'_k = W_k [RMSNorm(h_(k-1)); RMSNorm(Emb(t(i+k)))],   h_k = Block_k(h'_k),   logits_k = Output(RMSNorm_k(h_k))

Block_k is a causal block of the model's own kind (MLA and the MoE of its last layer); the embedding and the
output layer are the main model's. Its loss is the cross-entropy of logits_k against t(i+k+1), and the training
loss gains mtp_loss_weight / D x (loss_1 + ... + loss_D), each term a sum over tokens divided by the global token
count like the language-model loss, so it adds up over microbatches, stages and ranks to the same value as in one
process. It enters the gradient through `AddAuxLoss`: the logged `loss` stays the language model's, and each
depth's own mean cross-entropy is logged as `loss/mtp_k` (`mtp_stats`). Under training.loss_chunk_size the output
layer is a `ChunkedOutput` and each depth's cross-entropy is computed a chunk of tokens at a time, like the main loss
(`output_cross_entropy_sum`).

The tokens ahead come in the forward's `future_tokens` [batch, seq, D + 1]
(`torchpre.parallel.forward_inputs.future_tokens`), read from the sequence's inputs: so depth k trains on the
positions whose target t(i+k+1) is an input of the same row (seq - k - 1 per row). Positions past the row's end hold
`IGNORE_INDEX`. Under context parallelism they are taken from the whole rows and then cut to the rank's positions
like the inputs, so each position keeps its own tokens ahead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from torchpre.models.attention import DocumentMask
from torchpre.parallel.chunked_output import output_cross_entropy_sum
from torchpre.parallel.forward_inputs import IGNORE_INDEX


class MTPDepth(nn.Module):
    """One prediction depth: the two input norms, their projection back to the model width, a block, and the norm
    before the shared output layer (Hugging Face's enorm, hnorm, eh_proj, the layer, shared_head.norm)."""

    def __init__(self, dim: int, norm_eps: float, block: nn.Module) -> None:
        super().__init__()
        self.embedding_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.hidden_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.projection = nn.Linear(2 * dim, dim, bias=False)
        self.block = block
        self.norm = nn.RMSNorm(dim, eps=norm_eps)

    def forward(self, hidden: Tensor, embedded: Tensor, rope_cache: Tensor, doc_mask: DocumentMask | None) -> Tensor:
        """The previous depth's hidden states and the embedded tokens ahead -> this depth's hidden states."""
        joined = torch.cat((self.hidden_norm(hidden), self.embedding_norm(embedded)), dim=-1)
        return self.block(self.projection(joined), rope_cache, doc_mask=doc_mask)


class MultiTokenPrediction(nn.Module):
    """The D depths (`depths["1"]` .. `depths[str(D)]`) and their running statistics. `forward` returns the
    weighted MTP loss of a microbatch, already divided by the global token count (`loss_scale` = 1 / tokens per
    step, set through `ModelSpec.hooks.set_token_loss_scale`)."""

    loss_sums: Tensor
    target_counts: Tensor

    def __init__(self, depths: Sequence[MTPDepth], loss_weight: float, logit_multiplier: float = 1.0) -> None:
        super().__init__()
        self.depths = nn.ModuleDict({str(k): depth for k, depth in enumerate(depths, start=1)})
        self.loss_weight = loss_weight
        self.logit_multiplier = logit_multiplier  # a parametrization's (µP), as the main model's logits
        self.loss_scale: float | None = None
        self.register_buffer("loss_sums", torch.zeros(len(depths), dtype=torch.float64), persistent=False)
        self.register_buffer("target_counts", torch.zeros(len(depths), dtype=torch.float64), persistent=False)

    def reset_stats(self) -> None:
        self.loss_sums.zero_()
        self.target_counts.zero_()

    def forward(
        self,
        hidden: Tensor,
        ahead: Tensor,
        embed: Callable[[Tensor], Tensor],
        output: nn.Module,
        rope_cache: Tensor,
        doc_mask: DocumentMask | None,
    ) -> Tensor:
        """`hidden`: the main model's last block output; `ahead`: `future_tokens` of this microbatch's positions;
        `embed`: the shared embedding (with the model's multiplier); `output`: the shared output layer, bias-free, so
        the logit multiplier scales its input (the same logits whole or chunked). Records each depth's summed
        cross-entropy and target count."""
        total: Tensor | None = None
        for k, depth in self.depths.items():
            k = int(k)
            embedded = embed(ahead[..., k - 1].clamp(min=0))  # past the end: any id, its targets are ignored
            hidden = depth(hidden, embedded, rope_cache, doc_mask)
            targets = ahead[..., k]
            normed = depth.norm(hidden)
            if self.logit_multiplier != 1.0:
                normed = normed * self.logit_multiplier
            loss = output_cross_entropy_sum(output, normed, targets)
            with torch.no_grad():
                self.loss_sums[k - 1] += _local(loss).double()
                self.target_counts[k - 1] += (targets != IGNORE_INDEX).sum()
            total = loss if total is None else total + loss
        return total * (self.loss_weight / len(self.depths) * self.loss_scale)


def _local(value: Tensor) -> Tensor:
    """A replicated DTensor's value (the loss under loss parallel), a plain tensor as is."""
    return value.to_local() if isinstance(value, DTensor) else value


def mtp_stats(model_parts: Sequence[nn.Module], depth: int, device: torch.device) -> dict[str, float]:
    """`loss/mtp_k`: each depth's mean cross-entropy per target since the last call, for the whole job (the sums
    and counts added over every rank, then reset). Tensor-parallel ranks count the same targets and sums alike, so
    the ratio is unchanged. A collective: every rank calls it."""
    table = torch.zeros(2, depth, dtype=torch.float64, device=device)
    for part in model_parts:
        for module in part.modules():
            if isinstance(module, MultiTokenPrediction) and len(module.depths):
                table[0] += module.loss_sums
                table[1] += module.target_counts
                module.reset_stats()
    dist.all_reduce(table)
    return {f"loss/mtp_{k + 1}": float(table[0, k] / table[1, k]) for k in range(depth) if table[1, k] > 0}
