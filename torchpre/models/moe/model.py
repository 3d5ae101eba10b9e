"""Mixture-of-Experts decoder in plain PyTorch: Llama 3 with each feed-forward replaced by routed experts.

Each token's router picks `top_k` of `num_experts` SwiGLU experts (dropless: no capacity limit; the rule, softmax or
DeepSeek-V3's sigmoid with groups and a balancing bias, is in routing.py) and sums their outputs weighted by the
router scores, plus an optional always-on shared expert. The first `first_k_dense` blocks are dense.

No parallelism lives here. Expert parallelism wraps `MoE.experts` from outside: it shards the expert
weights on dim 0 over an `ep` mesh and intercepts the one `experts(sorted_tokens, counts)` call to send
each expert's tokens to the rank that holds it, which is why `GroupedExperts` runs as many experts as its
local weights have (tensor parallelism wraps the same call, around hidden-dimension shards). Everything
else (pipeline stages, KV caches, packed documents) is Llama 3's.

Training adds a sequence-level load-balancing loss to the gradient without changing what forward
returns (see `AddAuxLoss`), so the trainer's loss and pipeline schedules need not know about it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from torchpre.models.aux_loss import AddAuxLoss
from torchpre.models.init import InitRule, ParamInit
from torchpre.models.llama3.model import FeedForward, Transformer, TransformerBlock
from torchpre.models.llama3.model import init_rule as llama3_init_rule
from torchpre.models.moe.args import MoEArgs
from torchpre.models.moe.routing import Routing, expert_scores, route, z_loss
from torchpre.parallel.expert_parallel import counts_on_host
from torchpre.parallel.quantized_experts import GroupedMM


def local_shard(weight: Tensor) -> Tensor:
    """This rank's shard of a weight read directly rather than through its module (a plain weight as is).

    Expert parallelism shards the experts' weights by expert and dispatches tokens itself, tensor parallelism by
    hidden unit (or head) and sums the partial outputs itself: either way, compute with this rank's shard."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU MLPs stored as stacked weights: w2[e](silu(x w1[e]) * (x w3[e])).

    `grouped_mm`, None by default, replaces the grouped matmul from outside (low precision: quantize.experts, in
    torchpre.parallel.quantized_experts); the weights stay what they are."""

    def __init__(self, num_experts: int, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.grouped_mm: GroupedMM | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """A usable default, like nn.Linear's; models overwrite it with `init_weights`."""
        for weight in (self.w1, self.w2, self.w3):
            nn.init.trunc_normal_(weight, std=0.02)

    def forward(self, tokens: Tensor, counts: Tensor | list[int]) -> Tensor:
        """tokens [N, dim] grouped by expert (counts[i] consecutive rows for local expert i) -> [N, dim].

        Rows after the last group (padding) come back as zeros. `counts` may be on the device or already on the
        host (an expert-parallel dispatch reads them there for its all-to-all).

        In bf16, one grouped matmul per weight (`torch._grouped_mm`) runs every expert at once, from the counts
        where they are: no loop over experts, no host sync. Otherwise (see `_grouped_mm_takes`) a loop over the
        experts, which reads the counts on the host. A `grouped_mm` set from outside always runs grouped.
        """
        w1, w2, w3 = local_shard(self.w1), local_shard(self.w2), local_shard(self.w3)
        if len(counts) != w1.shape[0]:
            raise ValueError(f"got token counts for {len(counts)} experts, this module holds {w1.shape[0]}")
        if self.grouped_mm is not None or _grouped_mm_takes(tokens, w1, w2):
            counts = torch.as_tensor(counts, device=tokens.device)
            return _grouped_swiglu(tokens, counts, w1, w2, w3, self.grouped_mm or _high_precision_grouped_mm)
        sizes = counts if isinstance(counts, list) else counts_on_host(counts, tokens.shape[0])
        groups = torch.split(tokens[: sum(sizes)], sizes)
        outputs = [(F.silu(x @ w1[i]) * (x @ w3[i])) @ w2[i] for i, x in enumerate(groups)]
        outputs.append(tokens.new_zeros(tokens.shape[0] - sum(sizes), w2.shape[-1]))
        return torch.cat(outputs)


def _grouped_mm_takes(tokens: Tensor, *weights: Tensor) -> bool:
    """Whether `torch._grouped_mm` runs these operands everywhere we run: bf16 (its CUDA kernel's dtype, and the
    only one its meta kernel, hence compile and the dry run, accepts; on CPU it runs fp32 too, but not traced),
    rows of 16-byte multiples (a tiny model's or an odd tensor-parallel shard's are not), and on CUDA a Hopper
    or newer GPU."""
    operands = (tokens, *weights)
    if any(t.dtype != torch.bfloat16 or t.shape[-1] * t.element_size() % 16 for t in operands):
        return False
    return tokens.device.type != "cuda" or torch.cuda.get_device_capability(tokens.device) >= (9, 0)


def _high_precision_grouped_mm(tokens: Tensor, weights: Tensor, offsets: Tensor) -> Tensor:
    return torch._grouped_mm(tokens, weights, offs=offsets)


def _grouped_swiglu(
    tokens: Tensor, counts: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, grouped_mm: GroupedMM
) -> Tensor:
    """Every expert's SwiGLU on its group of rows in three grouped matmuls. `_grouped_mm` leaves the rows past
    the last group unwritten, forward and backward (whatever memory held, NaN included): each masked fill sets
    them to zero in its output and, in backward, in its input's gradient."""
    offsets = counts.cumsum(0).to(torch.int32)
    padding = (torch.arange(tokens.shape[0], device=tokens.device) >= offsets[-1]).unsqueeze(-1)
    tokens = tokens.masked_fill(padding, 0)
    hidden = F.silu(grouped_mm(tokens, w1, offsets)) * grouped_mm(tokens, w3, offsets)
    hidden = hidden.masked_fill(padding, 0)
    return grouped_mm(hidden, w2, offsets).masked_fill(padding, 0)


class MoE(nn.Module):
    """Top-k routed experts plus an optional shared expert: x [batch, seq, dim] -> [batch, seq, dim].

    In training mode it also adds `scale * sum_b (aux_loss_coeff * aux_b + router_z_loss_coeff * z_b)` to the
    gradient, where for each sequence b, aux_b = num_experts * sum_e f_e * P_e with f_e the fraction of b's top-k
    assignments that went to expert e and P_e b's mean score of e normalised over the experts (the sequence-wise
    aux loss), and z_b is b's mean router z-loss. Per sequence, so the total over microbatches and data-parallel
    ranks does not depend on how the global batch is split. `aux_loss_scale` is `scale`: None means 1 / this
    call's batch (a mean); the trainer sets 1 / global batch size.

    With `bias_update_rate` > 0 the persistent buffer `expert_bias` shifts the scores for the choice of experts
    (training state, checkpointed); `step_tokens_per_expert` counts the assignments since its last update, which
    the family's `after_optimizer_step` hook (router.py) sums over the job and applies.

    When x holds only part of each sequence (context parallelism), `sequence_sum` (set from outside) sums a
    per-sequence statistic over the ranks that hold the rest: f_e and P_e are then the whole sequence's, every such
    rank computes the same aux_b, and each adds its share of the sequence's tokens of it to the gradient.

    Router statistics accumulate in non-persistent buffers in training mode (`reset_stats` zeroes them):
    `tokens_per_expert` (assignments per expert), `aux_loss_sum` (sum_b aux_b, unscaled) and
    `aux_loss_sequences` (how many b). Activation-checkpoint recomputation counts a forward twice; only ratios
    of these are meant to be reported, and those it leaves unchanged.
    """

    tokens_per_expert: Tensor
    aux_loss_sum: Tensor
    aux_loss_sequences: Tensor
    expert_bias: Tensor | None
    step_tokens_per_expert: Tensor | None

    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        self.num_experts, self.top_k = args.num_experts, args.top_k
        self.routing = Routing(
            args.top_k, args.score_func, args.n_group, args.topk_group, args.norm_topk_prob, args.routed_scaling_factor
        )
        self.aux_loss_coeff, self.router_z_loss_coeff = args.aux_loss_coeff, args.router_z_loss_coeff
        self.aux_loss_scale: float | None = None
        self.sequence_sum: Callable[[Tensor], Tensor] | None = None
        self.router = nn.Linear(args.dim, args.num_experts, bias=False)
        self.experts = GroupedExperts(args.num_experts, args.dim, args.moe_hidden_dim)
        self.shared_expert = (
            FeedForward(args.dim, args.shared_expert_hidden_dim) if args.shared_expert_hidden_dim > 0 else None
        )
        # float32 explicitly: the trainer builds the model under a bf16 default dtype.
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts, dtype=torch.float32), persistent=False)
        self.register_buffer("aux_loss_sum", torch.zeros((), dtype=torch.float32), persistent=False)
        self.register_buffer("aux_loss_sequences", torch.zeros((), dtype=torch.float32), persistent=False)
        balanced = args.bias_update_rate > 0
        self.register_buffer("expert_bias", torch.zeros(args.num_experts, dtype=torch.float32) if balanced else None)
        self.register_buffer(
            "step_tokens_per_expert",
            torch.zeros(args.num_experts, dtype=torch.float32) if balanced else None,
            persistent=False,
        )

    @torch.no_grad()
    def reset_stats(self) -> None:
        self.tokens_per_expert.zero_()
        self.aux_loss_sum.zero_()
        self.aux_loss_sequences.zero_()

    def forward(self, x: Tensor) -> Tensor:
        bsz, seqlen, dim = x.shape
        tokens = x.reshape(-1, dim)
        # Routing in float32: the top-k choice and its weights are sensitive to rounding.
        logits = F.linear(tokens.float(), self.router.weight.float())
        scores = expert_scores(logits, self.routing.score_func)
        weights, expert_ids = route(scores, self.routing, self.expert_bias)  # [tokens, top_k]

        # Group the (token, k) assignments by expert; a stable sort keeps token order within each expert.
        flat_ids = expert_ids.flatten()
        order = torch.argsort(flat_ids, stable=True)
        # Not bincount: on CUDA it reads the largest id on the host to size its output, a sync per call.
        counts = flat_ids.new_zeros(self.num_experts).scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
        expert_out = self.experts(tokens[order // self.top_k], counts)
        expert_out = expert_out * weights.flatten()[order, None].to(expert_out.dtype)
        # Back to (token, k) order through the permutation, then a sum over k: deterministic on every device.
        unsorted = expert_out.new_empty(expert_out.shape).index_copy(0, order, expert_out)
        out = unsorted.view(-1, self.top_k, dim).sum(dim=1)
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)
        out = out.view(bsz, seqlen, dim)

        if self.training:
            affinity = scores if self.routing.score_func == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
            aux_per_sequence, share = self._aux_loss(affinity.view(bsz, seqlen, -1), expert_ids.view(bsz, -1))
            self._record(counts, aux_per_sequence)
            if torch.is_grad_enabled() and (self.aux_loss_coeff > 0 or self.router_z_loss_coeff > 0):
                penalty = self.aux_loss_coeff * aux_per_sequence.sum()
                if self.router_z_loss_coeff > 0:  # each sequence's mean z-loss (under cp: its share of the mean)
                    penalty = penalty + self.router_z_loss_coeff * z_loss(logits).view(bsz, seqlen).mean(dim=1).sum()
                scale = 1.0 / bsz if self.aux_loss_scale is None else self.aux_loss_scale
                out = AddAuxLoss.apply(out, scale * share * penalty)
        return out

    def _aux_loss(self, probs: Tensor, expert_ids: Tensor) -> tuple[Tensor, float | Tensor]:
        """aux_b per sequence [batch] from probs [batch, seq, experts] and expert_ids [batch, seq * top_k], and this
        rank's share of the sequences' tokens (1 unless `sequence_sum` spreads them over ranks)."""
        assignments = torch.zeros_like(probs[:, 0]).scatter_add_(
            1, expert_ids, torch.ones_like(expert_ids, dtype=probs.dtype)
        )
        if self.sequence_sum is None:
            fraction = assignments / expert_ids.shape[1]  # f_e: not differentiable, the router learns through P_e
            return self.num_experts * (fraction * probs.mean(dim=1)).sum(dim=-1), 1.0
        assignments = self.sequence_sum(assignments.detach())
        tokens = assignments.sum(dim=-1, keepdim=True) / self.top_k  # the whole sequence's
        mean_probs = self.sequence_sum(probs.sum(dim=1)) / tokens
        aux = self.num_experts * (assignments / (tokens * self.top_k) * mean_probs).sum(dim=-1)
        return aux, probs.shape[1] / tokens[0, 0]

    @torch.no_grad()
    def _record(self, counts: Tensor, aux_per_sequence: Tensor) -> None:
        self.tokens_per_expert += counts.to(self.tokens_per_expert.dtype)
        if self.step_tokens_per_expert is not None:
            self.step_tokens_per_expert += counts.to(self.step_tokens_per_expert.dtype)
        self.aux_loss_sum += aux_per_sequence.sum().to(self.aux_loss_sum.dtype)
        self.aux_loss_sequences += aux_per_sequence.shape[0]


class MoEBlock(TransformerBlock):
    """Llama 3's pre-norm block with routed experts, `moe`, in place of the dense feed-forward."""

    ffn_name = "moe"

    def build_ffn(self, args: MoEArgs) -> MoE:
        return MoE(args)


class MoETransformer(Transformer):
    """MoE decoder: tokens [batch, seq] -> logits [batch, seq, vocab]. Llama 3's `Transformer` (embedding,
    norm, output, RoPE, KV caches, pipeline-stage behaviour) with `MoEBlock` layers and the MoE init rule."""

    args: MoEArgs
    # A family built on this one (another attention, say) swaps its blocks here.
    moe_block: type[MoEBlock] = MoEBlock
    dense_block: type[TransformerBlock] = TransformerBlock

    def __init__(self, args: MoEArgs) -> None:
        super().__init__(args, block=self.moe_block)
        for layer_id in range(args.first_k_dense):
            self.layers[str(layer_id)] = self.dense_block(args)

    def param_init_rule(self, args: MoEArgs | None = None) -> InitRule:
        return init_rule(args or self.args)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Llama 3's, and the balancing biases at zero: training state that starts from nothing, not from the seed."""
        super().init_weights(seed)
        for moe in self.moe_layers():
            if moe.expert_bias is not None:
                moe.expert_bias.zero_()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """The RoPE cache, and zeroed router statistics and step counts (after `to_empty` they hold garbage)."""
        super().init_buffers()
        for moe in self.moe_layers():
            moe.reset_stats()
            if moe.step_tokens_per_expert is not None:
                moe.step_tokens_per_expert.zero_()

    def moe_layers(self) -> Iterator[MoE]:
        """The MoE modules this model (or pipeline stage) holds, through any AC or compile wrappers."""
        return (module for module in self.modules() if isinstance(module, MoE))

    def moe_layers_by_id(self) -> Iterator[tuple[int, MoE]]:
        """(layer index, MoE module) for each layer this model (or pipeline stage) holds."""
        for layer_id, block in self.layers.items():
            for module in block.modules():
                if isinstance(module, MoE):
                    yield int(layer_id), module

    def set_grouped_mm(self, grouped_mm: GroupedMM) -> int:
        """Every layer's routed experts run their matmuls through `grouped_mm`; returns how many layers."""
        layers = list(self.moe_layers())
        for moe in layers:
            moe.experts.grouped_mm = grouped_mm
        return len(layers)

    def set_aux_loss_scale(self, scale: float | None) -> None:
        """Every layer's `MoE.aux_loss_scale`: the trainer passes 1 / global batch size."""
        for moe in self.moe_layers():
            moe.aux_loss_scale = scale


def init_rule(args: MoEArgs) -> InitRule:
    """Llama 3's init (torchtitan's) for the names the models share; experts as its SwiGLU weights are (w1 std
    0.02, w2 and w3 shrinking with depth), router std 0.02. The generator key stays each parameter's own name.
    """
    llama_rule = llama3_init_rule(args)
    router = partial(nn.init.trunc_normal_, std=0.02)

    def as_feed_forward(fqn: str, layer_id: str, weight: str) -> ParamInit:
        fill = llama_rule(f"layers.{layer_id}.feed_forward.{weight}.weight").fill
        return ParamInit(fqn, fill)

    def rule(fqn: str) -> ParamInit:
        match fqn.split("."):
            case ["layers", _, "moe", "router", "weight"]:
                return ParamInit(fqn, router)
            case ["layers", layer_id, "moe", "experts", "w1" | "w2" | "w3" as weight]:
                return as_feed_forward(fqn, layer_id, weight)
            case ["layers", layer_id, "moe", "shared_expert", "w1" | "w2" | "w3" as weight, "weight"]:
                return as_feed_forward(fqn, layer_id, weight)
        try:
            return llama_rule(fqn)
        except KeyError:
            raise KeyError(f"no MoE init rule for parameter {fqn!r}") from None

    return rule
