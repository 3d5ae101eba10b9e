"""Data-parallel gradient buckets of ZeRO stages 0-2 (`DataParallel`): gradients land in flat buffers as backward
produces them, and each bucket's collective starts as soon as its last gradient is in, while backward goes on.

Every parameter has a post-accumulate-grad hook that adds its gradient into its bucket's buffer and frees
`.grad`. Buckets are built once, per (reduction group, pipeline part, parameter dtype), from the parameters in
reverse registration order (about the order backward produces them), cut at `bucket_bytes`; each part's
buckets are launched strictly in index order, so every rank issues the same collectives in the same order even
when a bucket waits for a parameter that got no gradient (it is launched by `finish()`). What one collective
moves per stage (the strategy's capabilities: replicated state, sharded state, sharded gradients):
- 0: a persistent buffer, tensor after tensor; all-reduced in place. The gradients are views of it.
- 1: a persistent buffer laid out rank-major (`ChunkLayout`: rank r's `torch.chunk` of every tensor in section r);
  the hook adds straight into the chunks' slots, one reduce-scatter writes this rank's summed section in place.
- 2: the same rank-major buffer, but transient: allocated at a bucket's first gradient of a microbatch,
  reduce-scattered when the bucket is complete, its section added into the persistent gradient shard (the
  only gradient memory kept: 1/dp of the full one), then freed. At most two such reduce-scatters are in flight.
  With `accumulate_locally`, or without overlap, the buffer instead lives across the microbatches and is
  reduce-scattered once (ZeRO-1's peak gradient memory during backward, 1/microbatches of the collectives).

When the reduction may start is told by `on_backward(part, last)`, which `ParallelModel.forward_backward` (and
the pipeline stages) call before each backward: stages 0 and 1 reduce during the last microbatch's backward,
stage 2 during every one. A backward nobody announced (a direct `loss.backward()`) only accumulates;
`finish()` then reduces everything. A gradient that reaches a bucket whose collective has started raises a
RuntimeError naming the parameter instead of being lost.

Across pipeline parts, launches interleave as the schedule runs the parts' backwards, which is the same on every
rank of a DP group (they hold the same stages); a parameter used on some DP ranks and not on others delays its
bucket to `finish()` on those ranks only, which keeps each part's order but could reorder two parts' buckets.
"""

import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from torchpre.distributed.collectives import ChunkLayout, all_reduce_flat, reduce_scatter_flat
from torchpre.parallel.data_parallel import DataParallel, ShardedParameter
from torchpre.parallel.tensor_parallel import local_gradient

# Launched, unfinished stage-2 reduce-scatters kept at once: each holds a full transient bucket buffer.
MAX_IN_FLIGHT = 2


def accumulation_dtype(param_dtype: torch.dtype, accumulate_in_fp32: bool) -> torch.dtype:
    """The dtype microbatch gradients are summed in: fp32, or the parameter's own (only to measure its error)."""
    if accumulate_in_fp32:
        return torch.float32
    return param_dtype


@dataclass(eq=False)
class GradBucket:
    """A run of parameters whose gradients one collective reduces."""

    index: int  # position in its part's launch order
    members: list[int]  # entry indices
    group: dist.ProcessGroup
    part: int
    layout: ChunkLayout
    dtype: torch.dtype  # of the accumulation
    buffer: torch.Tensor | None = None
    shard: torch.Tensor | None = None  # stage 2: this rank's summed section, across microbatches
    ready: set[int] = field(default_factory=set)
    launched: bool = False  # in this round (the step, or under stage 2 the microbatch)
    pending: bool = False  # launched, its result not yet where the gradients are read
    work: dist.Work | None = None
    sent: torch.Tensor | None = None  # what the collective reduces (the buffer, or its reduce_dtype copy)

    @property
    def group_size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def in_flight(self) -> bool:
        return self.work is not None


class GradBuckets:
    """The gradient buffers and collectives of ZeRO stages 0-2; see the module docstring.

    `domains` are (entry indices, group) pairs (dense parameters over dp, experts over edp). `strategy.reduce_dtype`
    is the dtype of the collective (bfloat16 halves its traffic; the result is added into the accumulation dtype).
    `tp_partial[i]`: the i-th gradient is a per-rank partial sum over TP (read from its DTensor as it arrives).
    """

    def __init__(
        self,
        entries: list[ShardedParameter],
        domains: list[tuple[list[int], dist.ProcessGroup]],
        strategy: DataParallel,
    ):
        self.entries, self.strategy = entries, strategy
        self.reduce_dtype, self.overlap = strategy.reduce_dtype, strategy.overlap_grad_reduce
        # Stage 2 reduce-scatters every microbatch, unless it sums them locally first, as stage 1 does.
        # Without overlap every stage reduces once, after the last microbatch.
        self.per_microbatch = strategy.reduces_each_microbatch
        self.transient = strategy.shards_gradients
        self.tp_partial = [False] * len(entries)
        self.buckets: list[GradBucket] = []
        for indices, group in domains:
            for part in sorted({entries[i].part for i in indices}, reverse=True):
                members = [i for i in reversed(indices) if entries[i].part == part]
                self._build(members, group, part, strategy.accumulate_in_fp32, strategy.bucket_bytes)
        self.bucket_of = {i: bucket for bucket in self.buckets for i in bucket.members}
        self.position = {i: k for bucket in self.buckets for k, i in enumerate(bucket.members)}
        # Each (group, part)'s buckets in launch order, and how many of them this round has launched.
        self._sequences: dict[tuple[int, int], list[GradBucket]] = {}
        for bucket in self.buckets:
            self._sequences.setdefault(_key(bucket), []).append(bucket)
        self._launched_count: dict[tuple[int, int], int] = dict.fromkeys(self._sequences, 0)
        self._announced: dict[int, bool] = {}  # part -> this backward may launch its buckets
        self._round_open: dict[int, bool] = {}  # part -> stage 2 (per microbatch): a microbatch's round is open
        self._in_flight: list[GradBucket] = []
        for i, entry in enumerate(entries):
            entry.param.register_post_accumulate_grad_hook(functools.partial(self._hook, i))

    def _build(
        self, members: list[int], group: dist.ProcessGroup, part: int, accumulate_in_fp32: bool, bucket_bytes: int
    ) -> None:
        world = dist.get_world_size(group) if self.strategy.shards_optimizer_state else 1
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i in members:
            by_dtype.setdefault(self.entries[i].local.dtype, []).append(i)
        for param_dtype, same_dtype in by_dtype.items():
            dtype = accumulation_dtype(param_dtype, accumulate_in_fp32)
            for run in _cut(same_dtype, [self.entries[i].local.numel() * dtype.itemsize for i in same_dtype],
                            bucket_bytes):
                layout = ChunkLayout([self.entries[i].local.shape for i in run], [self.entries[i].dim for i in run],
                                     world)
                index = sum(1 for b in self.buckets if b.group is group and b.part == part)
                bucket = GradBucket(index, run, group, part, layout, dtype)
                device = self.entries[run[0]].local.device
                if self.transient:
                    bucket.shard = torch.zeros(layout.rank_numel, dtype=dtype, device=device)
                else:
                    bucket.buffer = torch.zeros(layout.rank_numel * layout.world_size, dtype=dtype, device=device)
                self.buckets.append(bucket)

    # ---- during backward ---------------------------------------------------------------------------------------

    def on_backward(self, part: int, last: bool) -> None:
        """Called before each backward of pipeline part `part`; `last`: the step's last one for this part."""
        if self.per_microbatch and self._round_open.get(part):
            self._end_round(part)
        self._round_open[part] = True
        self._announced[part] = self.overlap and (self.per_microbatch or last)

    def _hook(self, i: int, param: nn.Parameter) -> None:
        local, self.tp_partial[i] = local_gradient(param, param.grad)
        param.grad = None
        bucket = self.bucket_of[i]
        self._add(bucket, i, local)
        if self._announced.get(bucket.part):
            bucket.ready.add(i)
            self._launch_ready(_key(bucket))

    def _add(self, bucket: GradBucket, i: int, grad: torch.Tensor) -> None:
        if bucket.launched:
            raise RuntimeError(
                f"The gradient of '{self.entries[i].name}' arrived after its bucket's data-parallel reduction "
                "started, so it would be lost. A backward outside ParallelModel.forward_backward must be announced "
                "with optimizer.buckets.on_backward(part, last), and gradients added after the last backward of a "
                "step are an error."
            )
        if bucket.buffer is None:  # stage 2: the microbatch's (or the step's) first gradient in this bucket
            self._allocate(bucket)
        bucket.layout.add_into(bucket.buffer, self.position[i], grad)

    def _allocate(self, bucket: GradBucket) -> None:
        """Stage 2's transient buffer: in the reduction dtype when it holds one microbatch."""
        dtype = self.reduce_dtype if self.per_microbatch else bucket.dtype
        bucket.buffer = bucket.shard.new_zeros(bucket.layout.rank_numel * bucket.layout.world_size, dtype=dtype)

    def _launch_ready(self, key: tuple[int, int]) -> None:
        """Launches, in index order, the next buckets of the (group, part) whose gradients are all in."""
        sequence = self._sequences[key]
        while self._launched_count[key] < len(sequence):
            bucket = sequence[self._launched_count[key]]
            if len(bucket.ready) < len(bucket.members):
                return
            self._launch(bucket)

    def _launch(self, bucket: GradBucket) -> None:
        bucket.launched = bucket.pending = True
        self._launched_count[_key(bucket)] += 1
        if bucket.buffer is None:  # stage 2: no gradient this round, but every rank must take part
            self._allocate(bucket)
        if bucket.group_size == 1:
            return
        if self.transient and len(self._in_flight) >= MAX_IN_FLIGHT:
            self._complete(self._in_flight[0])
        bucket.sent = bucket.buffer if bucket.buffer.dtype == self.reduce_dtype else bucket.buffer.to(self.reduce_dtype)
        if not self.strategy.shards_optimizer_state:
            bucket.work = all_reduce_flat(bucket.sent, bucket.group, async_op=True)
        else:
            mine = self._own_section(bucket, bucket.sent)
            bucket.work = reduce_scatter_flat(mine, bucket.sent, bucket.group, async_op=True)
        self._in_flight.append(bucket)

    def _complete(self, bucket: GradBucket) -> None:
        """Waits for the bucket's collective and puts the result where the gradients are read."""
        if not bucket.pending:
            return
        bucket.pending = False
        if bucket.work is not None:
            bucket.work.wait()
            self._in_flight.remove(bucket)
            bucket.work = None
        sent = bucket.sent if bucket.sent is not None else bucket.buffer
        if self.transient:
            bucket.shard.add_(self._own_section(bucket, sent))
            bucket.buffer = None
        elif sent is not bucket.buffer:
            if not self.strategy.shards_optimizer_state:
                bucket.buffer.copy_(sent)
            else:
                self._own_section(bucket, bucket.buffer).copy_(self._own_section(bucket, sent))
        bucket.sent = None

    @staticmethod
    def _own_section(bucket: GradBucket, flat: torch.Tensor) -> torch.Tensor:
        if bucket.layout.world_size == 1:
            return flat
        return flat.view(bucket.layout.world_size, bucket.layout.rank_numel)[dist.get_rank(bucket.group)]

    def _end_round(self, part: int) -> None:
        """Stage 2, per microbatch: launches the part's buckets not yet launched (in order), finishes them, and
        opens the next microbatch's round."""
        for bucket in self.buckets:
            if bucket.part == part and not bucket.launched:
                self._launch(bucket)
        for bucket in self.buckets:
            if bucket.part == part:
                self._complete(bucket)
                bucket.launched, bucket.ready = False, set()
                self._launched_count[_key(bucket)] = 0

    # ---- after backward ----------------------------------------------------------------------------------------

    def finish(self) -> list[torch.Tensor]:
        """Ends the step's backward: folds in gradients added without a hook, launches what is left in order, waits
        for every collective; returns each entry's DP-reduced gradient (its own chunk under stages 1-2), in the
        accumulation dtype, as views of the buffers."""
        self._fold_leftovers()
        for bucket in self.buckets:
            if not bucket.launched:
                self._launch(bucket)
        for bucket in self.buckets:
            self._complete(bucket)
            bucket.launched, bucket.ready = False, set()
        self._launched_count = dict.fromkeys(self._sequences, 0)
        self._announced.clear()
        self._round_open.clear()
        return self.reduced()

    def _fold_leftovers(self) -> None:
        for i, entry in enumerate(self.entries):
            if entry.param.grad is not None:
                local, self.tp_partial[i] = local_gradient(entry.param, entry.param.grad)
                entry.param.grad = None
                self._add(self.bucket_of[i], i, local)

    def reduced(self) -> list[torch.Tensor]:
        """Each entry's reduced gradient: views of the persistent buffers (stage 0: the whole local gradient;
        1: this rank's chunk; 2: this rank's chunk, in the gradient shard)."""
        grads: list[torch.Tensor | None] = [None] * len(self.entries)
        for bucket in self.buckets:
            rank = dist.get_rank(bucket.group) if bucket.layout.world_size > 1 else 0
            section = bucket.shard if self.transient else self._own_section(bucket, bucket.buffer)
            for i, grad in zip(bucket.members, bucket.layout.unpack_rank(section, rank)):
                grads[i] = grad
        return grads

    def local_gradients(self) -> list[torch.Tensor]:
        """Each entry's accumulated local gradient before any DP reduction, in fp32 (for tests and debugging:
        valid while no bucket has been reduced over more than one rank, e.g. at dp 1)."""
        self._fold_leftovers()
        grads: list[torch.Tensor | None] = [None] * len(self.entries)
        for bucket in self.buckets:
            if bucket.group_size > 1 and (bucket.launched or self.transient):
                raise RuntimeError("The local gradients are gone: they were reduced over data parallelism.")
            outputs = [torch.zeros_like(self.entries[i].local, dtype=bucket.dtype) for i in bucket.members]
            if bucket.buffer is not None:
                bucket.layout.unpack_all(bucket.buffer, outputs)
            if self.transient:  # one rank: the shard is the whole gradient of the microbatches already folded
                for output, folded in zip(outputs, bucket.layout.unpack_rank(bucket.shard, 0)):
                    output.add_(folded)
            for i, output in zip(bucket.members, outputs):
                grads[i] = output.float()
        return grads

    def zero_(self) -> None:
        """Clears the accumulated gradients for the next step."""
        for bucket in self.buckets:
            if bucket.shard is not None:
                bucket.shard.zero_()
                bucket.buffer = None
            else:
                bucket.buffer.zero_()

    def in_flight(self) -> list[GradBucket]:
        """Buckets whose collective was launched and not yet waited for."""
        return [bucket for bucket in self.buckets if bucket.in_flight]

    def grad_bytes(self) -> int:
        """Bytes of persistent gradient memory on this rank (transient stage-2 buffers not counted)."""
        return sum(b.shard.nbytes if b.shard is not None else b.buffer.nbytes for b in self.buckets)


def _key(bucket: GradBucket) -> tuple[int, int]:
    """Buckets with the same key are launched in one sequence: one reduction group, one pipeline part."""
    return id(bucket.group), bucket.part


def _cut(items: list[int], sizes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Consecutive runs of `items` of about `bucket_bytes` each (a larger item alone)."""
    runs: list[list[int]] = []
    run: list[int] = []
    total = 0
    for item, size in zip(items, sizes):
        if run and total + size > bucket_bytes:
            runs.append(run)
            run, total = [], 0
        run.append(item)
        total += size
    if run:
        runs.append(run)
    return runs
