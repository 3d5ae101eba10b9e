"""Low-precision linears through torchao: FP8 (tensorwise or rowwise scales) and MXFP8 (a scale per 32 values).

The conversion swaps `nn.Linear` modules of the plain model on the meta device for torchao's subclasses, before
pipeline splitting, tensor parallelism, activation checkpointing, compile and FSDP (the order torchtitan's float8
converter uses): the swapped modules keep their high-precision weight Parameter under the same name, so every
later step, the optimizer and the checkpoint see the model they would see without FP8. Only the matmuls cast
their inputs to FP8 on the fly; a checkpoint saved with FP8 on loads with it off and the reverse.

On a device without FP8 tensor cores (every CPU) torchao emulates the matmuls: the values are rounded to FP8 as
on a GPU, and the product is taken in high precision.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
from dataclasses import dataclass

import torch
from torch import nn

from torchpre.errors import ConfigError

logger = logging.getLogger(__name__)

# The CUDA compute capability whose tensor cores run each format: Ada/Hopper for FP8, Blackwell for MXFP8.
CAPABILITY = {"float8": (8, 9), "mxfp8": (10, 0)}
# The kernels take a linear only when both of its dimensions are multiples of this (MXFP8: one scale per 32).
DIVISOR = {"float8": 16, "mxfp8": 32}


@dataclass(frozen=True)
class QuantizePlan:
    """Which linears compute in low precision and how: `modules` are fnmatch patterns of module names."""

    linear: str
    recipe: str
    modules: tuple[str, ...]
    emulate: bool
    fsdp_float8_all_gather: bool = False


def resolve_emulate(linear: str, emulate: str, device: torch.device) -> bool:
    """Whether torchao emulates the low-precision matmuls: 'auto' does where `device` has no kernels for them;
    'false' on such a device is refused, naming the compute capability the format needs. Logged either way."""
    if device.type == "meta":  # a dry run: no matmul runs, and the GPU it plans for is not this machine's
        # MXFP8's casts are triton kernels, which meta tensors cannot run: the dry run traces the emulated ops.
        return emulate == "true" or linear == "mxfp8"
    needed = CAPABILITY[linear]
    has_kernels = device.type == "cuda" and torch.cuda.get_device_capability(device) >= needed
    what = f"quantize.linear = '{linear}'"
    if emulate == "false" and not has_kernels:
        found = (
            f"compute capability {'.'.join(map(str, torch.cuda.get_device_capability(device)))}"
            if device.type == "cuda"
            else f"a {device.type} device"
        )
        raise ConfigError(
            f"quantize.emulate = 'false' asks for {linear} kernels, which need a CUDA GPU of compute capability "
            f"{'.'.join(map(str, needed))} or newer; this job runs on {found}. Set quantize.emulate = 'auto' (emulated "
            f"{linear}: FP8 numerics, high-precision speed) or quantize.linear = 'none'."
        )
    emulated = emulate == "true" or not has_kernels
    if emulated:
        reason = "as asked (quantize.emulate = 'true')" if emulate == "true" else f"no {linear} kernels on {device}"
        logger.info("%s: emulated matmuls, %s", what, reason)
    else:
        logger.info("%s: %s kernels on %s", what, linear, device)
    return emulated


def convert_linears(model: nn.Module, plan: QuantizePlan) -> list[str]:
    """Swaps the linears of `model` whose names match `plan.modules` and whose dimensions the kernels take for
    torchao's low-precision linears, in place (on any device, meta included); returns the converted names."""
    if plan.linear == "none":
        return []
    divisor = DIVISOR[plan.linear]
    chosen, skipped = [], []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or not any(fnmatch.fnmatchcase(name, p) for p in plan.modules):
            continue
        fits = module.in_features % divisor == 0 and module.out_features % divisor == 0
        (chosen if fits else skipped).append(name)
    if skipped:
        logger.info(
            "quantize: %d linears stay in high precision (dimensions not multiples of %d): %s",
            len(skipped), divisor, ", ".join(skipped),
        )  # fmt: skip
    swap = _float8_linear(plan) if plan.linear == "float8" else _mxfp8_linear(plan)
    for name in chosen:
        owner, _, child = name.rpartition(".")
        parent = model.get_submodule(owner) if owner else model
        setattr(parent, child, swap(getattr(parent, child)))
    logger.info("quantize: %d linears in %s (%s)", len(chosen), plan.linear, plan.recipe)
    return chosen


def _float8_linear(plan: QuantizePlan):
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    config = dataclasses.replace(
        Float8LinearConfig.from_recipe_name(plan.recipe),
        emulate=plan.emulate,
        enable_fsdp_float8_all_gather=plan.fsdp_float8_all_gather,
    )
    return lambda linear: Float8Linear.from_float(linear, config=config)


def _mxfp8_linear(plan: QuantizePlan):
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    kernels = KernelPreference.EMULATED if plan.emulate else KernelPreference.AUTO

    def swap(linear: nn.Linear) -> MXFP8Linear:
        with torch.device("meta"):
            new = MXFP8Linear(
                linear.in_features, linear.out_features, bias=linear.bias is not None,
                kernel_preference=kernels, wgrad_with_hp=plan.recipe == "rowwise_with_gw_hp",
            )  # fmt: skip
        new.weight, new.bias = linear.weight, linear.bias
        return new

    return swap
