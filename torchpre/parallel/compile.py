"""torch.compile per transformer block: small graphs that compile once and are reused by every block."""

from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper


def compile_blocks(blocks: Iterable[nn.Module], per_child: bool = False, fullgraph: bool = True) -> None:
    """Compiles each block's forward in place (`Module.compile`), so module and parameter names stay
    as they are for checkpoints, tensor-parallel plans and pipeline splits.

    `per_child` compiles each child of a block (norms, attention, feed-forward) on its own instead, for two
    layouts. Under tensor parallelism, with its DTensor input/output hooks inside its graph: a whole
    tensor-parallel block compiled as one graph fails in backward on torch 2.14 (a plain gradient reaches a
    DTensor redistribution), while graphs per child train correctly. Under FSDP (ZeRO-3), which puts its
    all-gather and reduce-scatter hooks on the block: `Module.compile` compiles the module's hooks too, and
    FSDP's are skipped by dynamo (a graph break that fullgraph rejects), so they stay eager outside the
    children's graphs. The residual additions stay eager, and so does an activation-checkpoint wrapper
    around the block, which recomputes the compiled children.

    `fullgraph=False` lets blocks with data-dependent shapes (Mixture-of-Experts token counts) compile
    in pieces around the graph breaks.

    A block compiled per child takes its inputs as plain tensors (`_waited_inputs`): the first block's input is the
    embedding's tensor-parallel output, still an `AsyncCollectiveTensor` (the unwaited result of its all-reduce or
    reduce-scatter), and a compiled graph given one computes a wrong gradient for it on torch 2.14 (the embedding's
    gradient was 2.7% off the one-process run's while every other gradient matched: pytorch/pytorch#179849).
    """
    for block in blocks:
        if per_child:
            block.register_forward_pre_hook(_waited_inputs)
        modules = _block_children(block) if per_child else (block,)
        for module in modules:
            module.compile(fullgraph=fullgraph)


def _block_children(block: nn.Module) -> Iterable[nn.Module]:
    """The block's own children, also when activation checkpointing wrapped it (the wrapper's only child is
    the whole block, which would compile as the one graph that fails)."""
    if isinstance(block, ActivationWrapper):
        block = block._checkpoint_wrapped_module
    return block.children()


class _Waited(torch.autograd.Function):
    """An AsyncCollectiveTensor's value as a plain tensor (its collective waited for); the gradient passes through."""

    @staticmethod
    def forward(ctx, tensor: AsyncCollectiveTensor) -> Tensor:
        return tensor.trigger_wait()

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad


def _waited_inputs(module: nn.Module, args: tuple) -> tuple:
    return tuple(_Waited.apply(arg) if isinstance(arg, AsyncCollectiveTensor) else arg for arg in args)
