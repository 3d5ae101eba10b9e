"""Llama 3 hyperparameters, the released flavors, and the FLOP count used for MFU."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

from torchpre.errors import ConfigError, resolve_step
from torchpre.models.args import ArgsDefaults
from torchpre.models.parametrization import Parametrization


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 RoPE frequency scaling: stretch long wavelengths to extend the context."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class TransformerArgs(ArgsDefaults):
    """Shape of a Llama 3 model. Frozen so a shared flavor cannot be mutated; derive variants
    with `dataclasses.replace` (e.g. to set `vocab_size` from the tokenizer)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None  # None means n_heads (no grouped-query attention)
    vocab_size: int = 128256
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 131072
    tie_word_embeddings: bool = False
    # The feed-forward (model.mlp): Llama's gated SwiGLU, or GPT-2/MPT's non-gated GELU, exact (MPT's default, torch's)
    # or tanh-approximated (GPT-2's, Megatron-LM's fused bias-GELU).
    mlp: Literal["swiglu", "gelu", "gelu_tanh"] = "swiglu"
    parametrization: Parametrization = Parametrization()  # the standard one; see torchpre.models.parametrization

    # The model.* keys these args take over `ArgsDefaults` (torchpre.models.args.ModelArgs): the shape keys
    # (torchpre.models.shapes) and model.parametrization.
    shape_keys: ClassVar[tuple[str, ...]] = ("dim", "n_layers", "n_heads", "n_kv_heads")
    parametrized: ClassVar[bool] = True
    selectable_mlp: ClassVar[bool] = True

    @resolve_step
    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.dim % self.n_heads != 0:
            raise ConfigError(f"model dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ConfigError(
                f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ConfigError(f"head_dim {self.head_dim} must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def attention_head_dim(self) -> int:
        """The size of the query-key dot products, which the softmax scale divides by its square root."""
        return self.head_dim

    @property
    def gated_mlp(self) -> bool:
        """Whether the feed-forward has the gate projection w3 (SwiGLU) or only w1 and w2 (GELU)."""
        return self.mlp == "swiglu"

    @property
    def ffn_hidden_dim(self) -> int:
        """The feed-forward width, scaled by ffn_dim_multiplier and rounded up to multiple_of: 4*dim for GELU (GPT's),
        2/3 of it for SwiGLU (the same matmul FLOPs with its third matrix)."""
        hidden = 4 * self.dim if not self.gated_mlp else int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


_LLAMA_3_1_SCALING = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
_LLAMA_3_2_SCALING = RopeScaling(
    factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)

LLAMA3_FLAVORS: dict[str, TransformerArgs] = {
    # vocab_size is a placeholder: the trainer replaces it with the tokenizer's size.
    "debugmodel": TransformerArgs(
        dim=256, n_layers=6, n_heads=16, n_kv_heads=8, vocab_size=2048, max_seq_len=2048
    ),
    # The debug model with tied input/output embeddings, as in Llama 3.2 1B/3B.
    "debugmodel_tied": TransformerArgs(
        dim=256,
        n_layers=6,
        n_heads=16,
        n_kv_heads=8,
        vocab_size=2048,
        max_seq_len=2048,
        tie_word_embeddings=True,
    ),
    # The benchmarks' CPU model: big enough that matmuls dominate, small enough for 2 cores.
    "bench": TransformerArgs(
        dim=512, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=2048, max_seq_len=2048
    ),
    # For tests and smoke runs: seconds per run on a laptop CPU, still grouped-query attention.
    "tiny": TransformerArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=2048, multiple_of=32, max_seq_len=2048
    ),
    "1B": TransformerArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.5,
        multiple_of=256,
        rope_scaling=_LLAMA_3_2_SCALING,
        tie_word_embeddings=True,
    ),
    "3B": TransformerArgs(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        ffn_dim_multiplier=1.0,
        multiple_of=256,
        rope_scaling=_LLAMA_3_2_SCALING,
        tie_word_embeddings=True,
    ),
    "8B": TransformerArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,
        rope_scaling=_LLAMA_3_1_SCALING,
    ),
    "70B": TransformerArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=4096,
        rope_scaling=_LLAMA_3_1_SCALING,
    ),
    "405B": TransformerArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_dim_multiplier=1.2,
        multiple_of=4096,
        rope_scaling=_LLAMA_3_1_SCALING,
    ),
}


def flops_per_token(args: TransformerArgs, num_params: int, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward), the PaLM/torchtitan convention.

    Each weight used in a matmul costs 6 FLOPs per token (2 forward, 4 backward), so the dense
    term is 6 * (num_params - the input embedding table), because an embedding lookup does no
    arithmetic. `num_params` counts unique parameters of the whole model, so with tied
    embeddings the single shared table is kept: it still does the output projection. Attention
    scores and the weighted sum over values add 12 * n_layers * dim * seq_len (QK^T and AV, 2
    FLOPs per multiply-add, times 3 for the backward pass, ignoring the causal mask).
    """
    lookup_params = 0 if args.tie_word_embeddings else args.vocab_size * args.dim
    return 6 * (num_params - lookup_params) + 12 * args.n_layers * args.dim * seq_len
