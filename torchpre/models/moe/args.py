"""Mixture-of-Experts hyperparameters, the flavors, and the FLOP count (of the active parameters) used for MFU."""

from __future__ import annotations

from dataclasses import dataclass

from torchpre.errors import ConfigError
from torchpre.models.llama3.args import TransformerArgs
from torchpre.models.llama3.args import flops_per_token as dense_flops_per_token


@dataclass(frozen=True, kw_only=True)
class MoEArgs(TransformerArgs):
    """Shape of an MoE decoder: a Llama 3 `TransformerArgs` whose feed-forward is `num_experts` SwiGLU experts
    of width `moe_hidden_dim`, `top_k` of them per token, plus an optional always-on shared expert.

    `ffn_hidden_dim`, `multiple_of` and `ffn_dim_multiplier` are inherited but unused: no block is dense.
    The MoE fields are keyword-only (the inherited fields before them have defaults).
    """

    num_experts: int
    top_k: int
    moe_hidden_dim: int
    shared_expert_hidden_dim: int = 0  # 0: no shared expert
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1 (Mixtral, Qwen3-MoE)
    aux_loss_coeff: float = 0.01  # weight of the load-balancing loss added to the gradient

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
    """Parameters a token does not use: the routed experts it is not sent to, in every layer (3 SwiGLU matrices
    of dim x moe_hidden_dim per expert)."""
    return args.n_layers * (args.num_experts - args.top_k) * 3 * args.dim * args.moe_hidden_dim


def active_params(args: MoEArgs, num_params: int) -> int:
    """Parameters each token uses, out of the model's `num_params` (unique, embedding table included): the
    "A" in "46.7B total, 12.9B active"."""
    return num_params - inactive_params(args)


def flops_per_token(args: MoEArgs, num_params: int, seq_len: int) -> int:
    """Training FLOPs per token: the Llama 3 formula (6 per active matmul weight, the embedding lookup excluded,
    plus the attention scores) over the active parameters, i.e. attention, router, top_k experts, shared
    expert and output. Dispatch, sort and scatter are not counted, as norms and softmax are not."""
    return dense_flops_per_token(args, active_params(args, num_params), seq_len)
