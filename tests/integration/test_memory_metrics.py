"""`param_bytes`, `grad_bytes` and `optimizer_state_bytes` in metrics.jsonl match the ZeRO memory formulas exactly.

train.py at dp2 for 2 steps of the debug model with AdamW, per ZeRO stage and parameter dtype. Every dimension
ZeRO shards (dim 0 of each parameter) is divisible by 2 and 4, so the per-parameter formulas hold without
padding, to the byte: the only other state is AdamW's `step`, one 4-byte fp32 scalar per parameter tensor
(replicated on every rank, never sharded).
"""

import dataclasses
from fractions import Fraction

import pytest
import torch

from tests.launch import DEBUG, train_and_read_metrics
from torchpre.data.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer
from torchpre.models.llama3.model import Transformer
from torchpre.models.registry import get_flavor

pytestmark = pytest.mark.slow

DP = 2
STEP_BYTES = 4  # AdamW's "step": a float32 scalar tensor per parameter tensor


@dataclasses.dataclass(frozen=True)
class Row:
    """Bytes per parameter on one rank at data-parallel degree DP."""

    zero_stage: int
    dtype: str  # training.mixed_precision_param
    param: Fraction
    grad: Fraction
    state: Fraction  # AdamW's two fp32 moments, plus the fp32 master of a bf16 parameter

    def __str__(self) -> str:
        return f"zero{self.zero_stage}-{self.dtype}"


def row(zero_stage: int, dtype: str, param: float, grad: float, state: float) -> Row:
    return Row(zero_stage, dtype, Fraction(param), Fraction(grad), Fraction(state))


FP32, BF16 = "float32", "bfloat16"
ROWS = [
    row(0, FP32, 4, 4, 8),
    row(0, BF16, 2, 4, 12),
    row(1, FP32, 4, 4, Fraction(8, DP)),
    row(1, BF16, 2, 4, Fraction(12, DP)),
    row(2, FP32, 4, Fraction(4, DP), Fraction(8, DP)),
    row(2, BF16, 2, Fraction(4, DP), Fraction(12, DP)),
    # ZeRO-3: the sharded fp32 parameters are the masters, whatever the compute dtype.
    row(3, FP32, Fraction(4, DP), Fraction(4, DP), Fraction(8, DP)),
    row(3, BF16, Fraction(4, DP), Fraction(4, DP), Fraction(8, DP)),
]


def debug_model_parameters() -> list[torch.Size]:
    """The shapes of the debug model's parameters with the shipped tokenizer, as train.py builds it."""
    vocab_size = load_tokenizer(DEFAULT_TOKENIZER_PATH).vocab_size
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(get_flavor("llama3", "debugmodel"), vocab_size=vocab_size))
    return [param.shape for param in model.parameters()]


# CI: every stage once (bf16 where masters and dtypes differ); every row with -m zero_matrix.
CI_ROWS = {(0, FP32), (1, BF16), (2, BF16), (3, BF16)}


@pytest.mark.parametrize("case", [
    pytest.param(r, id=str(r), marks=() if (r.zero_stage, r.dtype) in CI_ROWS else pytest.mark.zero_matrix)
    for r in ROWS
])
def test_bytes_per_parameter_match_the_formula(case: Row, tmp_path):
    shapes = debug_model_parameters()
    assert all(shape[0] % 4 == 0 for shape in shapes)  # so dp 2 and 4 shard every parameter evenly
    num_params = sum(shape.numel() for shape in shapes)
    args = [*DEBUG, "--training.steps", "2", "--training.local_batch_size", "4",
            "--optimizer.name", "AdamW", "--optimizer.zero_stage", str(case.zero_stage),
            "--training.mixed_precision_param", case.dtype]
    last = train_and_read_metrics(args, DP, tmp_path)[-1]
    assert last["param_bytes"] == num_params * case.param
    assert last["grad_bytes"] == num_params * case.grad
    assert last["optimizer_state_bytes"] == num_params * case.state + STEP_BYTES * len(shapes)
