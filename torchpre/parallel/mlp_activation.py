"""An MLP whose activation is recomputed in backward: it keeps only its projections' outputs
(activation_checkpoint.recompute_mlp_activation; Megatron-Core's `--recompute-modules moe_act`, and what its fused
bias-SwiGLU saves).

Eager autograd keeps, per SwiGLU MLP w2(silu(w1 x) * w3 x), four tensors of the hidden width: w1's output (for
SiLU's backward), SiLU's output and w3's output (for the product's), and the product (for w2's weight gradient);
per GELU MLP two. `recompute_mlp_activation` makes the MLP's `activation` module an autograd function that saves
only its inputs (the projections' outputs), and registers its output as a tensor rebuilt in backward
(`torchpre.parallel.saved_tensors`), so w2 saves a marker for it: two tensors kept instead of four (GELU: one
instead of two). Backward computes the activation once more, when w2's backward first asks for its input, and the
activation's own backward differentiates that same recomputation: the same ops as eager autograd runs, so the
gradients are bitwise equal.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from torchpre.parallel.saved_tensors import active_table, local_tensor, rebuilt_saves


def recompute_mlp_activation(mlp: nn.Module) -> None:
    """Makes `mlp` (whose forward applies its child `activation` to its projections' outputs and passes the result
    to its last projection, and nothing else) keep only the activation's inputs for backward."""
    mlp.activation = RecomputedActivation(mlp.activation)
    rebuilt_saves(mlp)


class RecomputedActivation(nn.Module):
    """`activation`, whose output is rebuilt in backward when the MLP around it registers saved tensors (else, with
    no backward or under activation checkpointing, it runs as it is)."""

    def __init__(self, activation: nn.Module) -> None:
        super().__init__()
        self.activation = activation

    def forward(self, *inputs: Tensor) -> Tensor:
        table = active_table()
        if table is None:
            return self.activation(*inputs)
        recomputation = _Recomputation(self.activation)
        output = _KeepInputs.apply(recomputation, *inputs)
        table.register(output, recomputation.rebuild_with(inputs))
        return output


class _Recomputation:
    """One forward's activation, computed again in backward: w2's backward asks first (for its input), and the
    graph of that recomputation waits for the activation's own backward, which differentiates it and drops it."""

    def __init__(self, activation: nn.Module) -> None:
        self.activation = activation
        self.graph: tuple[tuple[Tensor, ...], Tensor] | None = None  # leaves and output, built by `rebuild_with`
        self.differentiated = False

    def rebuild_with(self, inputs: tuple[Tensor, ...]) -> Callable[[], Tensor]:
        """The activation's output (its local tensor) again from `inputs`, which the marker w2 saves holds, not the
        autograd node: they are freed with w2's saved tensors."""

        def rebuild() -> Tensor:
            if self.differentiated or not any(x.requires_grad for x in inputs):
                with torch.no_grad():
                    return local_tensor(self.activation(*inputs))
            self.graph = self.differentiable(inputs)
            return local_tensor(self.graph[1].detach())

        return rebuild

    def differentiable(self, inputs: tuple[Tensor, ...]) -> tuple[tuple[Tensor, ...], Tensor]:
        """The activation of detached `inputs` (the leaves), with the graph that differentiates it."""
        leaves = tuple(x.detach().requires_grad_(x.requires_grad) for x in inputs)
        with torch.enable_grad():
            return leaves, self.activation(*leaves)

    def input_grads(self, inputs: tuple[Tensor, ...], grad: Tensor) -> tuple[Tensor | None, ...]:
        leaves, output = self.graph if self.graph is not None else self.differentiable(inputs)
        self.graph, self.differentiated = None, True
        # w2's backward has used the output's values and autograd.grad needs only its graph: a scalar stands in for
        # them, so they are freed before the gradients below are allocated (eager autograd's peak, not one above).
        output.data = output.new_zeros(()).expand(output.shape)
        wanted = [leaf for leaf in leaves if leaf.requires_grad]
        grads = iter(torch.autograd.grad(output, wanted, grad))
        return tuple(next(grads) if leaf.requires_grad else None for leaf in leaves)


class _KeepInputs(torch.autograd.Function):
    """The activation, saving its inputs only."""

    @staticmethod
    def forward(ctx, recomputation: _Recomputation, *inputs: Tensor) -> Tensor:
        ctx.recomputation = recomputation
        ctx.save_for_backward(*inputs)
        return recomputation.activation(*inputs)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        return None, *ctx.recomputation.input_grads(ctx.saved_tensors, grad)
