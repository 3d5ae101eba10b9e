"""DeepSeek-V3 hyperparameters, the flavors, and the FLOP count (of the active parameters) used for MFU."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from torchpre.errors import ConfigError, resolve_step
from torchpre.models.moe.args import MoEArgs, active_params


@dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling as DeepSeek-V3 releases it (Hugging Face's `rope_type = "yarn"`): frequencies between the
    `beta_fast` and `beta_slow` rotation counts ramp from extrapolated to divided by `factor`; cos and sin are
    scaled by mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set, else by mscale(factor), or
    by `attention_factor` when it is given; the softmax by mscale(factor, mscale_all_dim)^2 (mscale(s, m) =
    0.1 m ln s + 1). `truncate` rounds the ramp's ends to whole dimensions (transformers' default; False keeps them
    fractional)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True, kw_only=True)
class DeepSeekV3Args(MoEArgs):
    """Shape of a DeepSeek-V3 decoder: an `MoEArgs` (its routing options, dense first blocks, shared expert) whose
    attention is multi-head latent attention (MLA):
    - queries from a `q_lora_rank` latent (with its RMSNorm), or straight from the input when it is 0 (the Lite
      models);
    - keys and values from one `kv_lora_rank` latent (with its RMSNorm) shared by all heads, each head's key
      `qk_nope_head_dim` wide from it plus a `qk_rope_head_dim` RoPE part computed once from the input and shared
      across heads; values `v_head_dim` wide.
    `dense_hidden_dim` is the width of the dense first blocks' feed-forward (`ffn_hidden_dim`); `n_kv_heads` and
    `rope_scaling` of the Llama fields do not apply (`yarn` is the RoPE scaling). The two latents' RMSNorms use
    `latent_norm_eps`, 1e-6 as released (transformers and DeepSeek's code fix it), not `norm_eps`.
    `mtp_depth` multi-token prediction depths after the main model (mtp.py; the released model has 1, trained with
    `mtp_loss_weight` 0.3 then 0.1), each with a block of the last layer's kind.
    """

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    dense_hidden_dim: int
    q_lora_rank: int = 0
    latent_norm_eps: float = 1e-6
    yarn: YarnScaling | None = None
    mtp_depth: int = 0
    mtp_loss_weight: float = 0.3

    shape_keys: ClassVar[tuple[str, ...]] = ("dim", "n_layers", "n_heads")  # MLA has no key/value heads
    predicts_ahead: ClassVar[bool] = True
    width_fields: ClassVar[tuple[str, ...]] = (
        "moe_hidden_dim", "shared_expert_hidden_dim", "q_lora_rank", "kv_lora_rank", "dense_hidden_dim",
    )

    @resolve_step
    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rope_scaling is not None:
            raise ConfigError(
                "Llama 3.1 RoPE scaling (model.rope_scaling_factor and the other model.rope_* scaling keys) does not "
                "apply to model.name = 'deepseek_v3', whose RoPE scaling is YaRN (the flavor's `yarn`): remove the "
                "keys (model.rope_theta applies)."
            )
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"model qk_rope_head_dim {self.qk_rope_head_dim} must be even for rotary embeddings")
        for key in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "dense_hidden_dim"):
            if getattr(self, key) < 1:
                raise ConfigError(f"model {key} {getattr(self, key)} must be at least 1")
        if self.q_lora_rank < 0:
            raise ConfigError(f"model q_lora_rank {self.q_lora_rank} must be >= 0 (0: no query latent)")
        if self.mtp_depth < 0 or self.mtp_loss_weight < 0:
            raise ConfigError(
                f"model.mtp_depth {self.mtp_depth} and model.mtp_loss_weight {self.mtp_loss_weight} must be >= 0"
            )
        if self.mtp_depth and self.tie_word_embeddings:
            raise ConfigError(
                "model.mtp_depth > 0 with tied embeddings: multi-token prediction shares the embedding through its own "
                "copy on the last pipeline stage, which a tied output layer would make a third; set model.mtp_depth = 0"
            )

    @property
    def router_rows(self) -> int:
        return self.n_layers + self.mtp_depth

    @property
    def routed_blocks(self) -> int:
        return len(self.moe_layer_ids) + (self.mtp_depth if self.mtp_block_is_moe else 0)

    @property
    def mtp_block_is_moe(self) -> bool:
        """Multi-token prediction blocks are of the last layer's kind: MoE unless every layer is dense."""
        return self.first_k_dense < self.n_layers

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def attention_head_dim(self) -> int:
        return self.qk_head_dim

    @property
    def ffn_hidden_dim(self) -> int:
        return self.dense_hidden_dim


_V3_YARN = YarnScaling(factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0)

# vocab_size is a placeholder: the trainer replaces it with the tokenizer's size. CPU-sized, every feature of
# the released model on: a query latent, sigmoid group-limited routing with bias balancing, a dense first block.
_DEBUGMODEL = DeepSeekV3Args(
    dim=64,
    n_layers=3,
    n_heads=4,
    vocab_size=2048,
    max_seq_len=2048,
    norm_eps=1e-6,
    rope_theta=10000.0,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    dense_hidden_dim=128,
    num_experts=8,
    top_k=2,
    moe_hidden_dim=32,
    shared_expert_hidden_dim=32,
    aux_loss_coeff=1e-4,
    score_func="sigmoid",
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    bias_update_rate=1e-3,
    first_k_dense=1,
)

DEEPSEEK_V3_FLAVORS: dict[str, DeepSeekV3Args] = {
    "debugmodel": _DEBUGMODEL,
    # One MoE block deeper (4 blocks): enough for every pipeline schedule at pp2, the interleaved and V-shaped ones
    # holding two stages per rank, each with a block.
    "debugmodel_pp": replace(_DEBUGMODEL, n_layers=4),
    # One GPU's DeepSeek-V3 for bench/gpu.sh: MLA with a query latent, 64 fine-grained experts top-6 in 8 groups (4
    # chosen), a shared expert twice as wide, one dense first block, DeepSeek-V3's vocabulary: 2.17B total, 0.67B
    # active (2.33B with one multi-token prediction depth).
    "2B": DeepSeekV3Args(
        dim=1536,
        n_layers=12,
        n_heads=12,
        vocab_size=129280,
        max_seq_len=4096,
        norm_eps=1e-6,
        rope_theta=10000.0,
        q_lora_rank=512,
        kv_lora_rank=256,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        dense_hidden_dim=4096,
        num_experts=64,
        top_k=6,
        moe_hidden_dim=512,
        shared_expert_hidden_dim=1024,
        aux_loss_coeff=1e-4,
        score_func="sigmoid",
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        bias_update_rate=1e-3,
        first_k_dense=1,
    ),
    # The 16B-class "lite" shape: Moonlight-16B-A3B (DeepSeek-V3's architecture; no query latent, ungrouped
    # routing over 64 experts, 2 shared): 16.0B total, 2.9B active.
    "lite": DeepSeekV3Args(
        dim=2048,
        n_layers=27,
        n_heads=16,
        vocab_size=163840,
        max_seq_len=8192,
        norm_eps=1e-5,
        rope_theta=50000.0,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        dense_hidden_dim=11264,
        num_experts=64,
        top_k=6,
        moe_hidden_dim=1408,
        shared_expert_hidden_dim=2 * 1408,
        aux_loss_coeff=1e-4,
        score_func="sigmoid",
        routed_scaling_factor=2.446,
        bias_update_rate=1e-3,
        first_k_dense=1,
    ),
    # DeepSeek-V3 as released (without its multi-token prediction module): 671.0B total, 37.6B active.
    "671B": DeepSeekV3Args(
        dim=7168,
        n_layers=61,
        n_heads=128,
        vocab_size=129280,
        max_seq_len=163840,
        norm_eps=1e-6,
        rope_theta=10000.0,
        yarn=_V3_YARN,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        dense_hidden_dim=18432,
        num_experts=256,
        top_k=8,
        moe_hidden_dim=2048,
        shared_expert_hidden_dim=2048,
        aux_loss_coeff=1e-4,
        score_func="sigmoid",
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        bias_update_rate=1e-3,
        first_k_dense=3,
    ),
}


def flops_per_token(args: DeepSeekV3Args, num_params: int, seq_len: int) -> int:
    """Training FLOPs per token: 6 per active matmul weight (the embedding lookup excluded: it does no arithmetic),
    plus the attention scores and weighted sum, 6 x n_layers x heads x (qk_head_dim + v_head_dim) x seq_len
    (QK^T and AV forward and backward, the causal mask ignored). Multi-token prediction adds its blocks' attention
    and one more use of the output layer per depth (the shared embedding and output counted once in `num_params`)."""
    lookup, output_reuse = args.vocab_size * args.dim, args.mtp_depth * args.vocab_size * args.dim
    matmul_params = active_params(args, num_params) - lookup + output_reuse
    blocks = args.n_layers + args.mtp_depth
    attention = 6 * blocks * args.n_heads * (args.qk_head_dim + args.v_head_dim) * seq_len
    return 6 * matmul_params + attention
