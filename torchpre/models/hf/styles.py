"""Tensor-parallel styles for transformers modules that torch's `ColwiseParallel`/`RowwiseParallel` do not take as
they are: GPT-2's `Conv1D` (a linear layer with its weight transposed), embeddings that scale their output by a
buffer (Gemma's), and the experts of a Mixture of Experts (3-D weights run by a loop over the experts)."""

from __future__ import annotations

import inspect
import types
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel


def _shard_parameters(placements: dict[str, Placement], name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for param_name, param in list(module.named_parameters(recurse=False)):
        sharded = distribute_tensor(param, mesh, [placements[param_name]], src_data_rank=None)
        module.register_parameter(param_name, nn.Parameter(sharded, requires_grad=param.requires_grad))


class Conv1DColwise(ColwiseParallel):
    """`ColwiseParallel` for transformers' Conv1D, whose weight is [in, out]: the weight is sharded on its output
    dimension (dim 1) and the bias with it."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            partial(_shard_parameters, {"weight": Shard(1), "bias": Shard(0)}),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class RowwiseOutputParallel(RowwiseParallel):
    """`RowwiseParallel` whose output is a tensor of its own rather than a view of the reduced DTensor's local
    tensor: transformers adds into a part's output in place (Falcon's `mlp_output += attention_output`), which
    autograd refuses on a view made by DTensor's `to_local`. The copy is one activation of the hidden width."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        outputs = RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        return outputs.clone() if use_local_output else outputs


class Conv1DRowwise(RowwiseOutputParallel):
    """`RowwiseParallel` for transformers' Conv1D: the weight is sharded on its input dimension (dim 0), the bias is
    replicated (added once, after the partial sums are reduced)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module,
            device_mesh,
            partial(_shard_parameters, {"weight": Shard(0), "bias": Replicate()}),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class VocabParallelEmbedding(RowwiseParallel):
    """`RowwiseParallel` for an embedding (vocabulary-parallel) whose forward also multiplies by a buffer (Gemma's
    `embed_scale`): the buffers become replicated DTensors, so the product stays a partial sum until reduced."""

    def _partition_embedding_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        super()._partition_embedding_fn(name, module, device_mesh)
        for buffer_name, buffer in list(module.named_buffers(recurse=False)):
            replicated = DTensor.from_local(buffer, device_mesh, [Replicate()], run_check=False)
            persistent = buffer_name not in module._non_persistent_buffers_set
            module.register_buffer(buffer_name, replicated, persistent=persistent)


class ExpertShards(ParallelStyle):
    """Whole experts per tensor-parallel rank: the experts' weights are sharded on the expert dimension, each rank
    runs its own experts on the (replicated) tokens routed to them, and the ranks' outputs are summed.

    transformers' experts modules take `(hidden_states, top_k_index, top_k_weights)` and skip the index
    `num_experts` (the slot for a token routed elsewhere, which transformers' own expert parallelism uses):
    each rank renumbers the indices of its experts from 0 and sends every other index to that slot, with weight 0.
    The gradients of the hidden states and routing weights, partial on each rank, are summed over the ranks in
    backward (`_SumGradients`).

    A shard runs the module's own loop over its experts (transformers' eager implementation): the grouped-matmul
    implementation leaves the rows of other ranks' slots unwritten, and its backward reads them.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        experts = module.num_experts
        local = experts // device_mesh.size()
        placements = {name: Shard(0) for name, _ in module.named_parameters(recurse=False)}
        _shard_parameters(placements, "", module, device_mesh)
        first = local * device_mesh.get_local_rank()
        module.num_experts = local
        module.forward = types.MethodType(inspect.unwrap(type(module).forward), module)
        module.register_forward_pre_hook(partial(_route_to_local_experts, device_mesh, first, local))
        module.register_forward_hook(partial(_sum_over_ranks, device_mesh))
        return module


def _route_to_local_experts(mesh: DeviceMesh, first: int, local: int, module: nn.Module, args: tuple) -> tuple:
    hidden_states, top_k_index, top_k_weights, *rest = args
    hidden_states, top_k_weights = _SumGradients.apply(mesh.get_group(), hidden_states, top_k_weights)
    module._routed = (hidden_states, top_k_weights)
    mine = (top_k_index >= first) & (top_k_index < first + local)
    top_k_index = torch.where(mine, top_k_index - first, local)
    # Weight 0 for the other ranks' slots, for implementations that run the slot too; masked after the gradient
    # sum, so that each rank's masked gradient adds up to the whole.
    top_k_weights = torch.where(mine, top_k_weights, 0.0)
    module._local_parameters = {name: param for name, param in module._parameters.items()}
    for name, param in module._local_parameters.items():
        module._parameters[name] = param.to_local()
    return hidden_states, top_k_index, top_k_weights, *rest


def _sum_over_ranks(mesh: DeviceMesh, module: nn.Module, args: tuple[object, ...], output: Tensor) -> Tensor:
    # An expert that got no token has no gradient, and a rank whose experts got none returns zeros that depend on
    # nothing. Tie the output to the inputs and to every local weight (adding 0), so that every rank's backward
    # reaches the gradient sum and every weight gets a gradient (zero), as the unsharded weight does.
    anchors = [*module.__dict__.pop("_routed"), *module._parameters.values()]
    module._parameters.update(module.__dict__.pop("_local_parameters"))
    output = output + 0.0 * sum(tensor.flatten()[0] for tensor in anchors)
    return _redistributed(output, mesh, Partial(), Replicate())


class _SumGradients(torch.autograd.Function):
    """The identity on the experts' inputs, whose backward sums their gradients over the ranks in one all-reduce.
    One autograd node for all of them: each rank's experts see different tokens, so the backward graphs differ
    in shape, and separate collectives could run in a different order on different ranks."""

    @staticmethod
    def forward(ctx: FunctionCtx, group: dist.ProcessGroup, *tensors: Tensor) -> tuple[Tensor, ...]:
        ctx.group = group
        return tuple(tensor.view_as(tensor) for tensor in tensors)

    @staticmethod
    def backward(ctx: FunctionCtx, *grads: Tensor) -> tuple[Tensor | None, ...]:
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        dist.all_reduce(flat, group=ctx.group)
        sizes = [grad.numel() for grad in grads]
        return (None, *(part.view_as(grad) for part, grad in zip(flat.split(sizes), grads)))


class GatherSequence(ParallelStyle):
    """Gathers a module's hidden-states input (its first argument, or `hidden_states`), which sequence parallelism
    holds sharded over the sequence (dimension 1): attention and feed-forward take the whole sequence."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(partial(_gather_hidden_states, device_mesh), with_kwargs=True)
        return module


def _gather_hidden_states(mesh: DeviceMesh, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if args:
        return (_redistributed(args[0], mesh, Shard(1), Replicate()), *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": _redistributed(kwargs["hidden_states"], mesh, Shard(1), Replicate())}


def _redistributed(tensor: Tensor, mesh: DeviceMesh, current: Placement, wanted: Placement) -> Tensor:
    """This rank's part of `tensor` (laid out as `current` over the ranks) laid out as `wanted`, differentiably."""
    return DTensor.from_local(tensor, mesh, [current], run_check=False).redistribute(placements=[wanted]).to_local()
