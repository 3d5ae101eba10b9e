"""Routed experts' grouped matmuls in MXFP8 through torchao's grouped path (`quantize.experts`).

A family's grouped-experts layer runs its SwiGLU as three grouped matmuls, tokens [N, K] grouped by expert times
weights [E, K, N'] given the groups' end offsets (`GroupedMM`). `quantize.experts` swaps that function, through the
family's `ParallelPlans.set_grouped_mm`, for torchao's `_to_mxfp8_then_scaled_grouped_mm`: each token row is cast to
MXFP8 in blocks of 32 along K, each expert's weight in blocks of 32 of its own, and the output gradient likewise in
backward; with `rowwise_with_gw_hp` the weight gradient stays in high precision. The weights stay the plain
high-precision Parameters, so expert, tensor and data parallelism, the optimizer and checkpoints see the model they
see without it, and a run turns it on or off at a resume.

torchao's kernels take bf16 operands: the tokens and weights are cast to bf16 first and the product returned in the
tokens' dtype (on a GPU, mixed precision already gives bf16). Each expert's group of tokens is padded to a multiple
of 32 rows inside the call, so no weight-gradient scale block spans two experts. On a device without MXFP8 kernels
(every CPU) torchao emulates them: the operands are rounded to MXFP8 as the kernels would, then multiplied in bf16.

Float8 experts are not built: torchao 0.18's float8 grouped matmul (rowwise only) runs on triton kernels with
`torch._scaled_grouped_mm` on CUDA, needs groups of 16 rows, and has no emulation to test it with here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import Tensor, nn

from torchpre.parallel.quantize import QuantizePlan

logger = logging.getLogger(__name__)

# (tokens [rows, K] grouped by expert, weights [experts, K, N], int32 end offsets [experts]) -> [rows, N]; rows past
# the last offset are left unwritten (as torch._grouped_mm leaves them).
GroupedMM = Callable[[Tensor, Tensor, Tensor], Tensor]


def quantize_experts(
    model: nn.Module, plan: QuantizePlan, set_grouped_mm: Callable[[nn.Module, GroupedMM], int]
) -> int:
    """Routes the grouped matmuls of every routed-experts layer of `model` through the plan's low-precision format
    (`set_grouped_mm` is the family's hook); returns how many layers."""
    grouped_mm = mxfp8_grouped_mm(emulate=plan.emulate, wgrad_with_hp=plan.recipe == "rowwise_with_gw_hp")
    layers = set_grouped_mm(model, grouped_mm)
    logger.info("quantize: the routed experts of %d layers in %s (%s)", layers, plan.linear, plan.recipe)
    return layers


def mxfp8_grouped_mm(*, emulate: bool, wgrad_with_hp: bool) -> GroupedMM:
    """torchao's MXFP8 grouped matmul with dynamic scales, as a `GroupedMM`."""
    from torchao.prototype.moe_training import _to_mxfp8_then_scaled_grouped_mm
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    kernels = KernelPreference.EMULATED if emulate else KernelPreference.AUTO

    def grouped_mm(tokens: Tensor, weights: Tensor, offsets: Tensor) -> Tensor:
        a, b = tokens.to(torch.bfloat16), weights.to(torch.bfloat16)
        if tokens.device.type == "meta":  # the dry run: no values to scale, the shapes and dtypes of the product
            return torch._grouped_mm(a, b, offs=offsets).to(tokens.dtype)
        # Emulated, torchao pads the groups with torch ops that take only the grouped rows: a host read of their count.
        grouped = int(offsets[-1]) if emulate else a.shape[0]
        out = _to_mxfp8_then_scaled_grouped_mm(
            a[:grouped], b.mT.contiguous().mT, offsets, out_dtype=torch.bfloat16, kernel_preference=kernels,
            wgrad_with_hp=wgrad_with_hp, pad_token_groups_for_grouped_mm=True,
        )  # the kernels take each expert's weight column-major ([E, K, N], K contiguous)
        return torch.cat([out, out.new_zeros(a.shape[0] - grouped, out.shape[1])]).to(tokens.dtype)

    return grouped_mm
