"""Auxiliary losses (a Mixture of Experts' load balancing, say) that enter the gradient from inside `forward`.

A model adds its auxiliary term where it computes it, `out = AddAuxLoss.apply(out, aux)`, instead of returning
it: under pipeline parallelism the loss exists on the last stage only, while the term may arise on any stage,
and the trainer's loss, its logged value and the pipeline schedules stay those of the language model. The
family's `ModelSpec.hooks.set_aux_loss_scale` hook receives `1 / global batch size` so that per-sequence terms, summed
over microbatches, stages and data-parallel ranks, add up to a mean over the global batch as the loss does.
"""

import torch
from torch import Tensor


class AddAuxLoss(torch.autograd.Function):
    """Returns `output` unchanged, and in backward gives `aux` the gradient 1, so the parameters' gradients
    gain d(aux)/d(params) as if `aux` had been added to the loss (Megatron's MoEAuxLossAutoScaler).

    The gradient is 1 whatever scale the loss is later given (gradient accumulation, loss scaling): put any
    such factor into `aux` itself (see `ModelSpec.hooks.set_aux_loss_scale`).
    """

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, output: Tensor, aux: Tensor) -> Tensor:
        ctx.save_for_backward(aux)
        return output

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_output: Tensor) -> tuple[Tensor, Tensor]:
        (aux,) = ctx.saved_tensors
        return grad_output, torch.ones_like(aux)

