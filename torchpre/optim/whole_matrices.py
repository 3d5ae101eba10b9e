"""Whole matrices out of their shards: each sharded matrix is assembled on one owner rank, transformed there once,
and the result's shards are sent back, so that an update that is not elementwise (Muon's orthogonalisation) sees
the matrix one process would see, under every layout.

A matrix is described by the DTensor its shard belongs to (its layout: mesh, placements, global shape). The mesh
dimensions whose placements cut one of its last two dimensions form its gather group; the ranks there hold the
pieces of the same matrices. Stacked matrices (a MoE's experts) are split over their first dimension by other
mesh dimensions (`ep`), whose ranks hold different matrices and are not gathered. Replicated mesh dimensions hold
copies: each copy's group assembles its own and computes the same result.

Owners are chosen greedily by size within each kind of group (the same choice on every member), so each rank
transforms about 1/g of the matrices of its groups of g. Which element of the matrix each shard holds comes from
DTensor itself (an arange redistributed from Replicate to the layout), so every placement DTensor knows (Shard,
uneven chunks, the `_StridedShard` of ZeRO within TP shards, FSDP2's) is assembled as DTensor would assemble it.
The pieces travel in one `all_to_all_single` over the world each way.

Bytes each rank sends per step: its shards of the matrices other ranks own, and the owned matrices' results for
the other members, about 2 · (g − 1)/g of its share of the matrices for groups of g (4 bytes per fp32 element).
"""

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement, _StridedShard


@dataclass(frozen=True)
class _Matrix:
    """One (stack of) matrices as this rank sees it: the placements that keep its gathered mesh dimensions whole
    (`whole`), the global ranks of its gather group (`members`; just this rank when nothing is gathered), its
    owner among them, and the shape the group assembles (`block`)."""

    layout: DTensor
    whole: tuple[Placement, ...]
    members: tuple[int, ...]
    owner: int
    block: torch.Size


def _cuts(placement: Placement, ndim: int) -> bool:
    """Whether `placement` splits one of the last two dimensions of a tensor with `ndim` dimensions."""
    return isinstance(placement, (Shard, _StridedShard)) and placement.dim >= ndim - 2


def _describe(layout: DTensor) -> tuple[tuple, tuple[Placement, ...], tuple[int, ...], torch.Size]:
    """The kind of gather group of `layout` (mesh and gathered dimensions), its placements with those dimensions
    replicated, the global ranks of this rank's group along them, and the block that group assembles."""
    mesh, placements = layout.device_mesh, layout.placements
    gathered = [i for i, p in enumerate(placements) if _cuts(p, layout.ndim) and mesh.size(i) > 1]
    whole = tuple(Replicate() if i in gathered else p for i, p in enumerate(placements))
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "every rank holds its part of the optimizer's mesh"
    index = tuple(slice(None) if i in gathered else c for i, c in enumerate(coordinate))
    members = tuple(mesh.mesh[index].flatten().tolist())
    block, _ = compute_local_shape_and_global_offset(layout.shape, mesh, whole)
    return (mesh.mesh_dim_names, tuple(gathered)), whole, members, torch.Size(block)


def _positions(matrix: _Matrix) -> torch.Tensor:
    """Where each element of this rank's shard sits in its group's block, flattened: an arange over the block,
    redistributed by DTensor from the gathered dimensions replicated to the layout."""
    layout = matrix.layout
    arange = torch.arange(matrix.block.numel(), dtype=torch.int64, device=layout.to_local().device)
    indices = DTensor.from_local(
        arange.view(matrix.block), layout.device_mesh, matrix.whole, run_check=False, shape=layout.shape,
        stride=layout.stride(),
    ).redistribute(layout.device_mesh, layout.placements)  # fmt: skip
    return indices.to_local().flatten()


class WholeMatrices:
    """Applies a function to whole matrices, given this rank's shards of them (`layouts`: the DTensor each shard
    belongs to). `apply(fn, shards)` returns this rank's shards of `fn(block)`, per matrix. It is one collective
    over the world (where any matrix is sharded): every rank calls it at the same point, in the same order.

    `device`: where the collectives' buffers live (the backend's device: CUDA for NCCL). `sent_bytes`: what this rank
    sent to other ranks in its last `apply`.
    """

    def __init__(self, layouts: Sequence[DTensor], device: torch.device):
        self.device = device
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.matrices: list[_Matrix] = []
        loads: dict[tuple, list[int]] = {}
        for layout in layouts:
            kind, whole, members, block = _describe(layout)
            load = loads.setdefault(kind, [0] * len(members))
            position = load.index(min(load))
            load[position] += block.numel()
            self.matrices.append(_Matrix(layout, whole, members, members[position], block))
        self.sent_bytes = 0
        self._routes: _Routes | None = None

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor], shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's shards of `fn(block)` for each matrix (`shards[k]`: this rank's part of the k-th); `fn` sees
        each (stack of) matrices whole, in its block's shape."""
        if self._routes is None:
            self._routes = _Routes.build(self) if self.world > 1 else _Routes.local()
        if not self._routes.exchanges:
            self.sent_bytes = 0
            return [fn(s.view(m.block)).view_as(s) for s, m in zip(shards, self.matrices)]
        routes, dtype = self._routes, shards[0].dtype if shards else torch.float32
        routes.sent_bytes = 0
        received = routes.to_owners([s.flatten() for s in shards], dtype)
        results = {}
        for k, positions in routes.positions.items():
            block = torch.empty(self.matrices[k].block.numel(), dtype=dtype, device=self.device)
            for source, where in positions.items():
                block[where] = received[(k, source)]
            result = fn(block.view(self.matrices[k].block)).flatten()
            results.update(((k, source), result[where]) for source, where in positions.items())
        returned = routes.to_members(results, dtype)
        self.sent_bytes = routes.sent_bytes
        return [value.view_as(shard) for value, shard in zip(returned, shards)]


@dataclass
class _Routes:
    """Who sends what to whom: `owners[k]`, the owner of matrix k; `sizes[(k, member)]`, the elements of a matrix
    owned here that each member holds; `positions[k][member]`, where they sit in its block; `numels[k]`, this
    rank's elements of matrix k. `sent_bytes` counts what this rank sent to others since it was reset."""

    exchanges: bool
    owners: list[int]
    sizes: dict[tuple[int, int], int]
    positions: dict[int, dict[int, torch.Tensor]]
    device: torch.device = torch.device("cpu")
    world: int = 1
    rank: int = 0
    numels: list[int] | None = None
    sent_bytes: int = 0

    @staticmethod
    def local() -> "_Routes":
        return _Routes(False, [], {}, {})

    @staticmethod
    def build(matrices: WholeMatrices) -> "_Routes":
        """The routes of `matrices`, agreed with the other ranks: each member sends the owner its shard's size and
        positions once (collectives over the world, so every rank builds them at its first `apply`)."""
        sharded = any(len(m.members) > 1 for m in matrices.matrices)
        flag = torch.tensor([int(sharded)], device=matrices.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            return _Routes.local()
        owned = [(source, k) for source in range(matrices.world) for k, m in enumerate(matrices.matrices)
                 if m.owner == matrices.rank and source in m.members]  # fmt: skip
        routes = _Routes(True, [m.owner for m in matrices.matrices], {(k, source): 1 for source, k in owned}, {},
                         matrices.device, matrices.world, matrices.rank)  # fmt: skip
        positions = [_positions(m) for m in matrices.matrices]
        sizes = routes.to_owners([torch.tensor([len(p)], device=matrices.device) for p in positions], torch.int64)
        routes.sizes = {key: int(value) for key, value in sizes.items()}
        for (k, source), where in routes.to_owners(positions, torch.int64).items():
            routes.positions.setdefault(k, {})[source] = where
        routes.numels = [len(p) for p in positions]
        return routes

    def _incoming(self) -> list[tuple[int, int]]:
        """(source, matrix) of what this rank receives as owner, in the order the sources send it."""
        return sorted((source, k) for k, source in self.sizes)

    def to_owners(self, pieces: Sequence[torch.Tensor], dtype: torch.dtype) -> dict[tuple[int, int], torch.Tensor]:
        """Sends `pieces[k]` to matrix k's owner; returns what this rank received, by (matrix, source)."""
        order = sorted(range(len(pieces)), key=lambda k: (self.owners[k], k))
        send_counts = _counts(self.world, ((self.owners[k], pieces[k].numel()) for k in order))
        incoming = self._incoming()
        receive_counts = _counts(self.world, ((source, self.sizes[(k, source)]) for source, k in incoming))
        output = self._all_to_all([pieces[k].to(dtype) for k in order], send_counts, receive_counts, dtype)
        split = output.split([self.sizes[(k, source)] for source, k in incoming])
        return {(k, source): value for (source, k), value in zip(incoming, split)}

    def to_members(self, results: dict[tuple[int, int], torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
        """The reverse of `to_owners`: each owner sends each member its part of the results; returns this rank's
        part of each matrix's result, in matrix order."""
        outgoing = self._incoming()
        send_counts = _counts(self.world, ((dest, results[(k, dest)].numel()) for dest, k in outgoing))
        assert self.numels is not None
        order = sorted(range(len(self.owners)), key=lambda k: (self.owners[k], k))
        receive_counts = _counts(self.world, ((self.owners[k], self.numels[k]) for k in order))
        output = self._all_to_all([results[(k, dest)] for dest, k in outgoing], send_counts, receive_counts, dtype)
        values = dict(zip(order, output.split([self.numels[k] for k in order])))
        return [values[k] for k in range(len(self.owners))]

    def _all_to_all(
        self, pieces: list[torch.Tensor], send_counts: list[int], receive_counts: list[int], dtype: torch.dtype
    ) -> torch.Tensor:
        payload = torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype, device=self.device)
        output = torch.empty(sum(receive_counts), dtype=dtype, device=self.device)
        dist.all_to_all_single(output, payload, receive_counts, send_counts)
        self.sent_bytes += (sum(send_counts) - send_counts[self.rank]) * dtype.itemsize
        return output


def _counts(world: int, entries: Iterable[tuple[int, int]]) -> list[int]:
    """Elements per rank, from (rank, elements) pairs."""
    counts = [0] * world
    for rank, count in entries:
        counts[rank] += count
    return counts
