"""Expert parallelism: experts sharded over the `ep` mesh, tokens dispatched to them with all-to-all.

A grouped-experts module takes `(tokens, counts)`: token rows grouped by expert, `counts[e]` rows for
expert e, for all E experts. `ExpertParallel` shards its weights [E, ...] on dim 0 over the ep ranks
(rank r holds experts r E/ep .. (r + 1) E/ep - 1) and wraps its forward:
- dispatch: the ranks exchange their counts, then their token rows (all-to-all), so each rank receives
  every rank's tokens for its own experts; those are regrouped by local expert;
- the module runs its local experts on them, given their row counts as a list: one host read per dispatch;
- combine: the outputs go back (the reverse all-to-all) in the order the tokens came in.
Both all-to-alls are differentiable, so the backward sends each token's gradient back to its expert's
rank and the expert weights receive the gradients of every rank's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor


@dataclass
class _Dispatch:
    """What the combine step needs to undo one dispatch."""

    send_splits: list[int]  # rows sent to each ep rank
    recv_splits: list[int]  # rows received from each ep rank
    order: Tensor  # received rows regrouped by local expert: local row i is received row order[i]


def counts_on_host(counts: Tensor, rows: int) -> list[int]:
    """`counts.tolist()`: the rows routed to each expert. On the meta device (the dry run, the planner), which holds
    no values, those of a balanced router, the `rows` spread evenly: the planning assumption, and what bias
    balancing steers towards."""
    if counts.device.type != "meta":
        return counts.tolist()
    base, extra = divmod(rows, counts.numel())
    return [base + (i < extra) for i in range(counts.numel())]


def apply_expert_parallel(experts: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shards `experts` (a grouped-experts module) in place over the 1-D `ep_mesh`; see the module doc."""
    distribute_module(experts, ep_mesh, _shard_experts, input_fn=_dispatch, output_fn=_combine)


def _shard_experts(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for key, param in list(module.named_parameters(recurse=False)):
        sharded = nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]), requires_grad=param.requires_grad)
        module.register_parameter(key, sharded)


def _dispatch(module: nn.Module, inputs: tuple[Tensor, Tensor], mesh: DeviceMesh) -> tuple[Tensor, list[int]]:
    tokens, counts = inputs
    group, ep = mesh.get_group(), mesh.size()
    local_experts = counts.numel() // ep
    send_counts = counts.view(ep, local_experts).contiguous()
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    # The one host sync of a dispatch: a dropless all-to-all's split sizes, and the row counts of the local
    # experts' loop, must be known on the host. Everything else derives from this one copy ([ep][local expert]).
    if tokens.device.type == "meta":  # balanced routing: every rank sends each expert, and receives, the same
        sent_counts = received_counts = torch.tensor(counts_on_host(counts, tokens.shape[0])).view(ep, -1).tolist()
    else:
        sent_counts, received_counts = torch.stack([send_counts, recv_counts]).tolist()
    send_splits, recv_splits = [sum(row) for row in sent_counts], [sum(row) for row in received_counts]
    received = funcol.all_to_all_single_autograd(tokens, recv_splits, send_splits, group)
    # Received rows come grouped by (source rank, local expert); the experts need them by local expert.
    rows = torch.arange(sum(recv_splits), device=tokens.device).split([n for row in received_counts for n in row])
    order = torch.cat([rows[source * local_experts + e] for e in range(local_experts) for source in range(ep)])
    module._ep_dispatch = _Dispatch(send_splits, recv_splits, order)
    return received[order], [sum(row[e] for row in received_counts) for e in range(local_experts)]


def _combine(module: nn.Module, output: Tensor, mesh: DeviceMesh) -> Tensor:
    dispatch: _Dispatch = module._ep_dispatch
    del module._ep_dispatch
    received_order = torch.empty_like(output).index_copy(0, dispatch.order, output)
    return funcol.all_to_all_single_autograd(
        received_order, dispatch.send_splits, dispatch.recv_splits, mesh.get_group()
    )
