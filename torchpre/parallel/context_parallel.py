"""Context parallelism: each sequence split over the cp ranks, attention still over the whole sequence.

Load balance (head-tail, as torch's `_HeadTailLoadBalancer`): the sequence is cut into 2 x cp chunks and cp rank i
holds chunks i and 2 x cp - 1 - i. Under a causal mask a query at position p sees p + 1 keys, so an early chunk
paired with a late one gives every rank the same attention work; a contiguous split would leave the last rank with
2 x cp - 1 times the first one's.

Attention: each rank projects only its own positions' queries, keys and values; the keys and values are
all-gathered over cp (`gather_sequence`: its backward reduce-scatters their gradients back) and put in position
order. Each of the rank's two query chunks then attends to the prefix of the sequence that ends with it, causally:
the keys after the chunk are masked for all its queries, so they are never computed. Without the document mask
that needs no mask at all (`torchpre.models.suffix_attention`: flash kernels on CUDA, the CPU flash kernel twice
merged by log-sum-exp on a CPU), and every rank computes the causal half of the scores as one process does, so
the work is one process's split evenly; with training.document_mask, a boolean mask of the chunk's queries over
the prefix's keys. Same numbers as one process either way.

All-gather rather than a ring of point-to-point passes: gloo runs collectives synchronously (nothing to overlap on
a CPU), and one all-gather per layer is one collective to keep in step under activation checkpointing and
pipeline schedules. The price is that a rank holds every key and value of the sequence for one layer at a time.

RoPE follows the shard: the attention gets the RoPE rows of its global positions. Labels are sharded like the
inputs, and the loss (summed token losses over the global token count) adds up over cp ranks as over dp ranks.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_autograd
from torch import Tensor
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from torchpre.distributed.comm_timer import counted_as
from torchpre.parallel.forward_inputs import future_tokens

# torch 2.14 renamed the flat-tensor collectives (the old names warn on every call); older torch has only those.
# Looked up by name at each call, so that the communication timer (`CommTimer`), which wraps them, times them.
_ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
_REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
_all_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd

Batch = tuple[Tensor, Tensor]


class AttentionKernels(NamedTuple):
    """The kernels cp attention calls, the model layer's (`torchpre.models.suffix_attention.causal_suffix_attention`
    and `torchpre.models.attention.masked_attention`); q, k, v and outputs are [batch, seq, heads, head_dim].
    `causal_suffix(q, k, v)`: queries that are the last positions of the keys' sequence, each attending to the keys
    up to itself; `masked(q, k, v, mask)`: a boolean mask [batch, 1, queries, keys] (True: attend)."""

    causal_suffix: Callable[[Tensor, Tensor, Tensor], Tensor]
    masked: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def head_tail_positions(seq_len: int, cp: int, rank: int) -> Tensor:
    """The global positions cp rank `rank` holds: chunks `rank` and 2 x cp - 1 - `rank` of 2 x cp equal chunks."""
    chunk = seq_len // (2 * cp)
    head = torch.arange(rank * chunk, (rank + 1) * chunk)
    tail = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)
    return torch.cat((head, tail))


class ContextParallel:
    """One rank's part of context parallelism over the 1-D `mesh` (cp ranks), for sequences of `seq_len`.

    `shard` cuts a batch to this rank's positions; `rope_rows` and `attend` are what a model family's attention
    hook (`ModelSpec.parallel.context_parallel`) uses instead of the positions 0.. and the local causal kernel. With
    `document_bos` (the BOS id, under training.document_mask) `forward_kwargs` reads the batch's document
    boundaries from the whole rows, and `document_attention` makes the attention of one microbatch's. `kernels`
    compute the attention.
    """

    def __init__(
        self,
        mesh: DeviceMesh,
        seq_len: int,
        device: torch.device,
        kernels: AttentionKernels,
        document_bos: int | None = None,
        tokens_ahead: int = 0,
    ):
        self.mesh, self.kernels, self.document_bos, self.device = mesh, kernels, document_bos, device
        self.tokens_ahead = tokens_ahead
        self.seq_len = 0
        self._use_seq_len(seq_len)

    def _use_seq_len(self, seq_len: int) -> None:
        """This rank's positions of `seq_len`-token sequences and its query chunks: a data stage may change the
        length, and validation runs at training.seq_len."""
        if seq_len == self.seq_len:
            return
        cp, rank = self.mesh.size(), self.mesh.get_local_rank()
        self.seq_len = seq_len
        self.positions = head_tail_positions(seq_len, cp, rank).to(self.device)
        # The gathered keys come in rank order (every rank's positions); this puts them in position order.
        gathered_positions = torch.cat([head_tail_positions(seq_len, cp, r) for r in range(cp)])
        self._by_position = gathered_positions.argsort().to(self.device)
        # This rank's two query chunks: their rows among its positions, and how many keys they see (the prefix of
        # the sequence up to the chunk's end).
        chunk = seq_len // (2 * cp)
        self._chunks = ((slice(0, chunk), (rank + 1) * chunk), (slice(chunk, 2 * chunk), (2 * cp - rank) * chunk))

    def shard(self, batch: Batch) -> Batch:
        """This rank's positions of (inputs, labels) [batch, seq]; the model then attends over sequences of their
        length."""
        inputs, labels = batch
        self._use_seq_len(inputs.shape[1])
        return inputs.index_select(1, self.positions), labels.index_select(1, self.positions)

    def rope_rows(self, rope_cache: Tensor) -> Tensor:
        """The rows of a [max_seq, ...] RoPE table at this rank's positions, in its order."""
        return rope_cache.index_select(0, self.positions)

    def forward_kwargs(self, inputs: Tensor) -> dict[str, Tensor]:
        """What the model's forward gets besides this rank's tokens [batch, seq/cp]: under the document mask,
        `document_ids` [batch, seq], the whole rows' documents (a new one at every BOS, numbered over the gathered
        tokens) in position order. Per row, so a pipeline schedule cuts them into microbatches
        with the tokens and hands each stage its microbatch's; the model's hook (`document_attention`) turns them
        into the attention's mask. With `tokens_ahead` (multi-token prediction), `future_tokens` [batch, seq/cp,
        tokens_ahead]: the tokens after each of this rank's positions, read from the whole rows."""
        if self.document_bos is None and not self.tokens_ahead:
            return {}
        rows = gather_sequence(inputs, self.mesh.get_group()).index_select(1, self._by_position)
        kwargs = {}
        if self.tokens_ahead:
            kwargs["future_tokens"] = future_tokens(rows, self.tokens_ahead)[:, self.positions]
        if self.document_bos is not None:
            kwargs["document_ids"] = (rows == self.document_bos).cumsum(dim=1)
        return kwargs

    def document_attention(self, document_ids: Tensor) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
        """`attend` within the documents of `document_ids` (from `forward_kwargs`), as the attention's doc_mask."""
        return partial(self.attend, document_ids=document_ids)

    def sequence_sum(self, statistic: Tensor) -> Tensor:
        """A per-sequence statistic summed over the cp ranks (each holds part of the sequence); its gradient flows
        back to every rank's part (MoE's load-balancing loss). torch 2.14 warns on every rank that this
        differentiable all-reduce is deprecated in favour of the functional one, which is differentiable in 2.14 but
        not known to be at the floor (2.11): the warning is silenced here until the floor moves."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed.nn.functional.all_reduce", FutureWarning)
            return dist_autograd.all_reduce(statistic, group=self.mesh.get_group())

    def attend(self, q: Tensor, k: Tensor, v: Tensor, document_ids: Tensor | None = None) -> Tensor:
        """Attention of this rank's queries [batch, seq/cp, heads, head_dim] over the whole sequence's keys and
        values (gathered here), causal in global positions and, with `document_ids` (`forward_kwargs`), within
        documents. Each query chunk attends to the keys up to its end only: the rest are all masked."""
        group = self.mesh.get_group()
        k, v = (gather_sequence(t, group).index_select(1, self._by_position) for t in (k, v))
        outputs = []
        for rows, end in self._chunks:
            queries, keys, values = q[:, rows], k[:, :end], v[:, :end]
            if document_ids is None:
                outputs.append(self.kernels.causal_suffix(queries, keys, values))
                continue
            documents = document_ids[:, :end]
            same_document = documents[:, end - queries.shape[1] :, None] == documents[:, None, :]
            mask = same_document.tril(end - queries.shape[1])[:, None]
            outputs.append(self.kernels.masked(queries, keys, values, mask))
        return torch.cat(outputs, dim=1)


def gather_sequence(shard: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Every rank's `shard` [batch, seq/cp, ...] concatenated along the sequence (dim 1) in rank order; the
    gradient of the result is summed back over `group` to each rank's part (a reduce-scatter). Inside a compiled
    graph the functional collectives, which the graph holds as nodes."""
    if torch.compiler.is_compiling():
        return _all_gather_autograd(shard.contiguous(), 1, group)
    return _GatherSequence.apply(shard, group)


class _GatherSequence(torch.autograd.Function):
    """The all-gather of `gather_sequence` and its reduce-scatter backward, both blocking torch.distributed
    collectives. Not the functional collectives' autograd all-gather: on gloo, its asynchronous all-gather and
    reduce-scatter corrupted the heap under a pipeline schedule (cp2 x pp2 1F1B aborted with `malloc(): unaligned
    tcache chunk detected` or a segfault in about half of 40-step runs; blocking collectives: none in 18)."""

    @staticmethod
    def forward(ctx, shard: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        stacked = shard.new_empty((size * shard.shape[0], *shard.shape[1:]))
        with counted_as("cp"):
            getattr(dist, _ALL_GATHER)(stacked, shard.contiguous(), group=group)
        return torch.cat(stacked.chunk(size), dim=1)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        size = dist.get_world_size(ctx.group)
        stacked = torch.cat(grad.chunk(size, dim=1))
        shard = stacked.new_empty((stacked.shape[0] // size, *stacked.shape[1:]))
        with counted_as("cp"):
            getattr(dist, _REDUCE_SCATTER)(shard, stacked, group=ctx.group)
        return shard, None
