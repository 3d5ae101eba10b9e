"""Mixture-of-Experts hyperparameters, the flavors, and the FLOP count (of the active parameters) used for MFU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from torchpre.errors import ConfigError, resolve_step
from torchpre.models.llama3.args import TransformerArgs
from torchpre.models.llama3.args import flops_per_token as dense_flops_per_token


@dataclass(frozen=True, kw_only=True)
class MoEArgs(TransformerArgs):
    """Shape of an MoE decoder: a Llama 3 `TransformerArgs` whose feed-forward is `num_experts` SwiGLU experts
    of width `moe_hidden_dim`, `top_k` of them per token, plus an optional always-on shared expert.

    The routing options (DeepSeek-V3's; the defaults are Mixtral's softmax top-k):
    - `score_func`: each expert's affinity, a softmax over the experts or a sigmoid per expert;
    - `n_group`, `topk_group`: group-limited routing, the experts in `n_group` equal groups, each token choosing
      its top-k among the `topk_group` groups with the largest sum of their two best scores;
    - `norm_topk_prob`: the chosen scores renormalised to sum to 1, then times `routed_scaling_factor`;
    - `bias_update_rate`: auxiliary-loss-free balancing, a per-expert bias added to the scores for the choice only,
      moved after each optimizer step by this rate towards the mean load (0: off, no bias);
    - `router_z_loss_coeff`: weight of the router z-loss, the mean squared log-sum-exp of the router logits;
    - `first_k_dense`: the first k blocks have a dense SwiGLU feed-forward of width `ffn_hidden_dim` instead.

    `ffn_hidden_dim`, `multiple_of` and `ffn_dim_multiplier` size only those dense blocks.
    The MoE fields are keyword-only (the inherited fields before them have defaults).
    """

    num_experts: int
    top_k: int
    moe_hidden_dim: int
    shared_expert_hidden_dim: int = 0  # 0: no shared expert
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1 (Mixtral, Qwen3-MoE)
    aux_loss_coeff: float = 0.01  # weight of the load-balancing loss added to the gradient
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    bias_update_rate: float = 0.0
    router_z_loss_coeff: float = 0.0
    first_k_dense: int = 0

    width_fields: ClassVar[tuple[str, ...]] = ("moe_hidden_dim", "shared_expert_hidden_dim")
    selectable_mlp: ClassVar[bool] = False  # the experts (and dense first blocks) are SwiGLU

    @resolve_step
    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_experts < 1:
            raise ConfigError(f"model num_experts {self.num_experts} must be at least 1")
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"model top_k {self.top_k} must be between 1 and num_experts {self.num_experts}")
        if self.moe_hidden_dim < 1:
            raise ConfigError(f"model moe_hidden_dim {self.moe_hidden_dim} must be at least 1")
        if self.shared_expert_hidden_dim < 0:
            raise ConfigError(
                f"model shared_expert_hidden_dim {self.shared_expert_hidden_dim} must be >= 0 (0: no shared expert)"
            )
        if self.aux_loss_coeff < 0:
            raise ConfigError(f"model aux_loss_coeff {self.aux_loss_coeff} must be >= 0 (0 disables the aux loss)")
        self._check_routing()

    def _check_routing(self) -> None:
        if self.score_func not in ("softmax", "sigmoid"):
            raise ConfigError(f"model score_func {self.score_func!r} must be 'softmax' or 'sigmoid'")
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ConfigError(f"model n_group {self.n_group} must divide num_experts {self.num_experts}")
        group_size = self.num_experts // self.n_group
        if self.n_group > 1 and group_size < 2:
            raise ConfigError(f"model n_group {self.n_group} leaves fewer than 2 experts per group (groups are "
                              "ranked by the sum of their two best scores)")  # fmt: skip
        if not 1 <= self.topk_group <= self.n_group or self.top_k > self.topk_group * group_size:
            raise ConfigError(
                f"model topk_group {self.topk_group} must be between 1 and n_group {self.n_group}, with top_k "
                f"{self.top_k} at most the {self.topk_group * group_size} experts of that many groups"
            )
        for key in ("routed_scaling_factor", "bias_update_rate", "router_z_loss_coeff"):
            if getattr(self, key) < 0:
                raise ConfigError(f"model {key} {getattr(self, key)} must be >= 0")
        if not 0 <= self.first_k_dense <= self.n_layers:
            raise ConfigError(f"model first_k_dense {self.first_k_dense} must be between 0 and n_layers "
                              f"{self.n_layers}")  # fmt: skip

    @property
    def moe_layer_ids(self) -> range:
        """The blocks whose feed-forward is routed experts (the others are dense)."""
        return range(self.first_k_dense, self.n_layers)

    @property
    def router_rows(self) -> int:
        """Rows of the per-layer router tables (statistics, balancing loads): one per block that can route, a
        family's extra blocks after the main ones (DeepSeek-V3's multi-token prediction)."""
        return self.n_layers

    @property
    def routed_blocks(self) -> int:
        """How many blocks have routed experts."""
        return len(self.moe_layer_ids)


MOE_FLAVORS: dict[str, MoEArgs] = {
    # vocab_size is a placeholder: the trainer replaces it with the tokenizer's size.
    "debugmodel": MoEArgs(
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=2048,
        max_seq_len=2048,
        num_experts=8,
        top_k=2,
        moe_hidden_dim=64,
        shared_expert_hidden_dim=64,
    ),
    # For tests: still grouped-query attention, several experts per token and a shared expert.
    "tiny": MoEArgs(
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=2048,
        max_seq_len=2048,
        num_experts=4,
        top_k=2,
        moe_hidden_dim=32,
        shared_expert_hidden_dim=32,
    ),
    # For tests: DeepSeek-V3's routing (sigmoid scores, group-limited top-k, scaling, bias balancing, z-loss) on
    # the tiny shape, the first block dense.
    "tiny_dsv3": MoEArgs(
        dim=32,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=2048,
        max_seq_len=2048,
        multiple_of=32,
        num_experts=8,
        top_k=2,
        moe_hidden_dim=16,
        shared_expert_hidden_dim=16,
        aux_loss_coeff=0.001,
        score_func="sigmoid",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        bias_update_rate=1e-3,
        router_z_loss_coeff=1e-3,
        first_k_dense=1,
    ),
    # Mistral's released shapes (46.7B total, 12.9B active; 141B total, 39B active).
    "mixtral-8x7B": MoEArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=32000,
        rope_theta=1e6,
        max_seq_len=32768,
        num_experts=8,
        top_k=2,
        moe_hidden_dim=14336,
    ),
    "mixtral-8x22B": MoEArgs(
        dim=6144,
        n_layers=56,
        n_heads=48,
        n_kv_heads=8,
        vocab_size=32768,
        rope_theta=1e6,
        max_seq_len=65536,
        num_experts=8,
        top_k=2,
        moe_hidden_dim=16384,
    ),
    # A torchpre shape, not a published checkpoint: 16 fine-grained experts (top-2) plus a shared expert of
    # the same width, in the style of Qwen/DeepSeek MoEs, with the Llama 3 vocabulary. 6.8B total, 1.9B active.
    "16E-A2B": MoEArgs(
        dim=2048,
        n_layers=28,
        n_heads=16,
        n_kv_heads=4,
        max_seq_len=8192,
        num_experts=16,
        top_k=2,
        moe_hidden_dim=2048,
        shared_expert_hidden_dim=2048,
    ),
}


def inactive_params(args: MoEArgs) -> int:
    """Parameters a token does not use: the routed experts it is not sent to, in every MoE layer (3 SwiGLU matrices
    of dim x moe_hidden_dim per expert)."""
    return args.routed_blocks * (args.num_experts - args.top_k) * 3 * args.dim * args.moe_hidden_dim


def active_params(args: MoEArgs, num_params: int) -> int:
    """Parameters each token uses, out of the model's `num_params` (unique, embedding table included): the
    "A" in "46.7B total, 12.9B active"."""
    return num_params - inactive_params(args)


def flops_per_token(args: MoEArgs, num_params: int, seq_len: int) -> int:
    """Training FLOPs per token: the Llama 3 formula (6 per active matmul weight, the embedding lookup excluded,
    plus the attention scores) over the active parameters, i.e. attention, router, top_k experts, shared
    expert and output. Dispatch, sort and scatter are not counted, as norms and softmax are not."""
    return dense_flops_per_token(args, active_params(args, num_params), seq_len)
