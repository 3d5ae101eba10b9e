"""Per-op selective activation checkpointing keeps attention: the attention kernel runs once per block in forward
and not again in backward, where full checkpointing (and a policy without the attention op) runs it again.

The count is taken below autograd, by a dispatch mode that sees each aten op a kernel runs: a recomputed op shows
up in backward, a saved one does not (per-op checkpointing hands back the saved output without running it).
"""

import dataclasses
from collections import Counter

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from torchpre.config.job_config import JobConfig
from torchpre.config.parser import parse_args
from torchpre.config.validate import validate_config
from torchpre.errors import ConfigError
from torchpre.models import attention
from torchpre.models.llama3.args import LLAMA3_FLAVORS
from torchpre.models.llama3.model import Transformer
from torchpre.parallel import activation_checkpoint
from torchpre.parallel.activation_checkpoint import apply_activation_checkpointing, slots

ARGS = dataclasses.replace(LLAMA3_FLAVORS["tiny"], vocab_size=128, max_seq_len=16)  # dim 64, 2 blocks, GQA
BATCH, SEQ = 2, 16
# The kernel SDPA runs for these inputs on CPU (fp32, causal, 4-D).
ATTENTION = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that run while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


def attention_runs(mode: str, option: str = "op", kernel=ATTENTION) -> tuple[int, int]:
    """How often the attention `kernel` runs in forward and in backward of the tiny model under `mode`."""
    torch.manual_seed(0)
    model = Transformer(ARGS)
    model.init_weights(0)
    apply_activation_checkpointing(slots(model.layers), mode, option)
    tokens = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ))
    with OpCounter() as forward:
        loss = model(tokens).square().mean()
    with OpCounter() as backward:
        loss.backward()
    return forward.counts[kernel], backward.counts[kernel]


def test_the_counted_op_is_the_one_sdpa_runs_on_cpu():
    assert attention_runs("none") == (ARGS.n_layers, 0)


def test_op_selective_checkpointing_does_not_recompute_attention():
    assert attention_runs("selective", "op") == (ARGS.n_layers, 0)


def test_full_checkpointing_recomputes_attention():
    """The counter sees a recompute: full checkpointing runs each block's attention again in backward."""
    assert attention_runs("full") == (ARGS.n_layers, ARGS.n_layers)


def test_op_policy_without_the_attention_op_recomputes_it(monkeypatch: pytest.MonkeyPatch):
    """The saved-op list is what keeps attention: take the op out and backward runs it again."""
    without_attention = activation_checkpoint._saved_ops() - {ATTENTION}
    monkeypatch.setattr(activation_checkpoint, "_saved_ops", lambda: without_attention)
    assert attention_runs("selective", "op") == (ARGS.n_layers, ARGS.n_layers)


@pytest.mark.parametrize(
    "op",
    [
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
        torch.ops.aten._scaled_dot_product_cudnn_attention.default,
        torch.ops.higher_order.flex_attention,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
        torch.ops._c10d_functional.all_reduce.default,
        torch.ops._c10d_functional.all_to_all_single.default,
    ],
    ids=str,
)
def test_the_fast_attention_kernels_and_collectives_are_saved(op):
    """The CUDA kernels cannot run here; this holds their ops in the list (all exist in torch 2.11 and 2.14)."""
    assert op in activation_checkpoint._saved_ops()


def test_the_sequence_parallel_all_gather_is_recomputed():
    """Its output is tp times its input: keeping it would undo sequence parallelism's memory saving."""
    assert torch.ops._c10d_functional.all_gather_into_tensor.default not in activation_checkpoint._saved_ops()


# flash-attn (>= 2.6) registers its forward as the operator `flash_attn::_flash_attn_forward`. flash-attn needs CUDA;
# a stand-in registered under its name (SDPA, with SDPA's gradients) lets the CPU count it like the real one.
@torch.library.custom_op("flash_attn::_flash_attn_forward", mutates_args=())
def _flash_attn_stand_in(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return attention.sdpa(q, k, v, mask=None, is_causal=True)


@_flash_attn_stand_in.register_fake
def _(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return torch.empty_like(q)


def _stand_in_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _stand_in_backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    _, vjp = torch.func.vjp(lambda q, k, v: attention.sdpa(q, k, v, mask=None, is_causal=True), *ctx.saved_tensors)
    return vjp(grad)


_flash_attn_stand_in.register_autograd(_stand_in_backward, setup_context=_stand_in_setup)


def test_op_selective_checkpointing_does_not_recompute_flash_attn(monkeypatch: pytest.MonkeyPatch):
    """The path `causal_attention` takes on CUDA when flash-attn is installed: its op is kept too."""
    monkeypatch.setattr(attention, "flash_attention_applies", lambda device, dtype: True)
    monkeypatch.setattr(
        attention, "flash_attn_func", lambda q, k, v, causal, deterministic: _flash_attn_stand_in(q, k, v)
    )
    activation_checkpoint._saved_ops.cache_clear()  # the list is built once, after flash-attn registered its op
    flash = torch.ops.flash_attn._flash_attn_forward.default
    try:
        assert attention_runs("selective", "op", kernel=flash) == (ARGS.n_layers, 0)
        assert attention_runs("full", kernel=flash) == (ARGS.n_layers, ARGS.n_layers)
    finally:
        activation_checkpoint._saved_ops.cache_clear()


@pytest.mark.parametrize("option", ["0", "every", "-2"])
def test_a_selective_option_that_is_neither_op_nor_a_positive_count_stops_in_validation(tmp_path, option):
    """Checked with the [activation_checkpoint] keys before any work, not when the blocks are wrapped."""
    config = parse_args(JobConfig, ["--job.dump_folder", str(tmp_path), "--activation_checkpoint.mode", "selective",
                                    "--activation_checkpoint.selective_ac_option", option])  # fmt: skip
    with pytest.raises(ConfigError, match=f"selective_ac_option = '{option}': use 'op' or a positive integer N"):
        validate_config(config)
