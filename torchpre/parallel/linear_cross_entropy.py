"""The output projection and cross-entropy over chunks of tokens, so the [tokens, vocabulary] logits never exist whole
(training.loss_chunk_size).

At Llama 3's 128,256-token vocabulary the fp32 logits of one 8,192-token sequence take 4.2 GB, and cross-entropy's
log-softmax and gradient as much again. Here the projection and the cross-entropy run `chunk_size` tokens at a time.
The forward keeps one number per token, its log-normalizer (the logsumexp of its logits); the backward recomputes each
chunk's logits from the saved hidden states and weight, turns them in place into the softmax minus the one-hot label,
and adds the chunk's share to the gradients of both. At most one chunk's logits exist at any time, in the forward and
in the backward, whatever a pipeline schedule keeps in flight between them.

The alternative, both gradients computed during the forward (Liger-Kernel's fused linear cross-entropy), spares the
recomputation (a quarter of the output layer's matmul work) but holds the weight's fp32 gradient, [vocab, dim], from
each microbatch's forward to its backward: one per microbatch in flight at the last pipeline stage (all of them under
GPipe), 2.1 GB each at Llama 3 8B, 4x a 1,024-token chunk's logits. Both are measured in docs/performance.md
(`python -m bench.loss_memory`).

Under tensor parallelism (`VocabShard`) the weight is a Shard(0) DTensor, sharded over the vocabulary: each rank
computes its shard of every chunk's logits, the maximum and the sum of exponentials are reduced over tp (the label's
logit, which one rank holds, too), and the hidden states are a Replicate DTensor whose gradient each rank holds as a
partial sum over its shard, which DTensor reduces. This is loss parallel, per chunk.

The loss and the weight's gradient accumulate in fp32 whatever the parameters' dtype; each chunk's logits are the
matmul's output cast to fp32, as `F.cross_entropy(logits.float())` sees them.
"""

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from torchpre.parallel.forward_inputs import IGNORE_INDEX


@dataclass(frozen=True)
class VocabShard:
    """The vocabulary rows this rank's weight holds, from `start`, and the group of the ranks holding the others
    (None: this rank holds them all)."""

    start: int = 0
    group: dist.ProcessGroup | None = None


def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, chunk_size: int) -> Tensor:
    """The summed token cross-entropy of the logits `hidden @ weight.T`, in fp32, computed `chunk_size` tokens at a
    time; a label equal to `IGNORE_INDEX` adds nothing. `hidden` [..., dim] and `labels` [...] are plain tensors, or
    under tensor parallelism `hidden` is a Replicate DTensor and `weight` [vocab, dim] a Shard(0) DTensor."""
    weight, shard = vocab_shard(weight)
    if shard.group is not None:
        if not isinstance(hidden, DTensor) or hidden.placements != (Replicate(),):
            raise ValueError("a vocabulary-sharded weight needs the hidden states as a Replicate DTensor")
        hidden = hidden.to_local(grad_placements=[Partial()])  # each rank's gradient: its vocabulary shard's share
    # Views: the nodes behind the inputs are then never a leaf's gradient accumulator, which `_wanted` cannot ask
    # about inside `torch.autograd.grad` (the zero-bubble schedules' backward passes).
    hidden, weight = hidden.view(-1, hidden.shape[-1]), weight.view(weight.shape)
    return _LinearCrossEntropy.apply(hidden, weight, labels.flatten(), chunk_size, shard)


@torch.no_grad()
def linear_log_probs(hidden: Tensor, weight: Tensor, targets: Tensor, chunk_size: int) -> Tensor:
    """Each token's log-probability of its target under the logits `hidden @ weight.T`, fp32 [tokens], `chunk_size`
    tokens at a time (evaluation: no gradient). `hidden` [tokens, dim] is the same on every tensor-parallel rank."""
    weight, shard = vocab_shard(weight)
    hidden = hidden.to_local() if isinstance(hidden, DTensor) else hidden
    log_probs = torch.empty(targets.shape, dtype=torch.float32, device=hidden.device)
    for rows in _chunks(len(targets), chunk_size):
        log_normalizer, target = _scores(hidden[rows], weight, targets[rows], shard)
        log_probs[rows] = target - log_normalizer
    return log_probs


def vocab_shard(weight: Tensor) -> tuple[Tensor, VocabShard]:
    """The local [vocab rows, dim] of the output weight and where its rows start: a Shard(0) DTensor's shard (rows cut
    as `torch.chunk` cuts them, DTensor's rule) and its mesh's group, or a plain tensor whole."""
    if not isinstance(weight, DTensor):
        return weight, VocabShard()
    mesh = weight.device_mesh
    if mesh.ndim != 1 or weight.placements != (Shard(0),):
        raise ValueError(f"the output weight must be sharded over the vocabulary (Shard(0)), not {weight.placements}")
    rows = -(-weight.shape[0] // mesh.size())
    return weight.to_local(), VocabShard(min(mesh.get_local_rank() * rows, weight.shape[0]), mesh.get_group())


class _LinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of `hidden @ weight.T` over chunks of rows; the backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, chunk_size: int, shard: VocabShard) -> Tensor:
        log_normalizers = torch.empty(labels.shape, dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for rows in _chunks(len(labels), chunk_size):
            log_normalizers[rows], target = _scores(hidden[rows], weight, labels[rows], shard)
            total += torch.where(labels[rows] != IGNORE_INDEX, log_normalizers[rows] - target, 0.0).sum()
        ctx.save_for_backward(hidden, weight, labels, log_normalizers)
        ctx.chunk_size, ctx.shard = chunk_size, shard
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, labels, log_normalizers = ctx.saved_tensors
        want_hidden, want_weight = _wanted(ctx)
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        scale = torch.where(labels != IGNORE_INDEX, grad_loss, 0.0)
        for rows in _chunks(len(labels), ctx.chunk_size):
            grad_logits = _grad_logits(hidden[rows], weight, labels[rows], log_normalizers[rows], ctx.shard.start)
            grad_logits.mul_(scale[rows, None])
            if grad_hidden is not None:
                grad_hidden[rows] = grad_logits.to(weight.dtype) @ weight
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.T, hidden[rows].float())
            del grad_logits  # before the next chunk's logits exist
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None


def _chunks(tokens: int, chunk_size: int) -> Iterator[slice]:
    return (slice(start, min(start + chunk_size, tokens)) for start in range(0, tokens, chunk_size))


def _scores(hidden: Tensor, weight: Tensor, labels: Tensor, shard: VocabShard) -> tuple[Tensor, Tensor]:
    """One chunk's log-normalizers (logsumexp over the whole vocabulary) and label logits (0 for an ignored label),
    fp32 [tokens] each. Its logits exist only here; the exponentials are taken in place."""
    logits = (hidden @ weight.T).float()
    target = _label_logits(logits, labels, shard.start)
    maximum = logits.amax(dim=1)
    if shard.group is not None:
        dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=shard.group)
    sums = logits.sub_(maximum[:, None]).exp_().sum(dim=1)
    if shard.group is not None:
        both = torch.stack((sums, target))
        dist.all_reduce(both, group=shard.group)
        sums, target = both
    return maximum + sums.log(), target


def _label_logits(logits: Tensor, labels: Tensor, start: int) -> Tensor:
    """Each row's logit of its label where this vocabulary shard holds it, else 0."""
    local, held = _local_labels(labels, start, logits.shape[1])
    return torch.where(held, logits.gather(1, local[:, None]).squeeze(1), 0.0)


def _grad_logits(hidden: Tensor, weight: Tensor, labels: Tensor, log_normalizers: Tensor, start: int) -> Tensor:
    """One chunk's softmax minus the one-hot label, fp32 [tokens, vocabulary shard], from its recomputed logits."""
    probs = (hidden @ weight.T).float().sub_(log_normalizers[:, None]).exp_()
    local, held = _local_labels(labels, start, probs.shape[1])
    return probs.scatter_add_(1, local[:, None], -held.to(probs.dtype)[:, None])


def _local_labels(labels: Tensor, start: int, rows: int) -> tuple[Tensor, Tensor]:
    """Labels as indices into a shard of `rows` vocabulary rows from `start` (clamped into it), and which it holds."""
    local = labels - start
    return local.clamp(0, rows - 1), (local >= 0) & (local < rows)


def _wanted(ctx) -> tuple[bool, bool]:
    """Which of the hidden states' and the weight's gradients this backward must produce: those autograd needs, less
    the ones the running backward does not reach. The zero-bubble schedules run an input-only and then a weight-only
    backward through this node, and each would otherwise recompute both."""
    needed = ctx.needs_input_grad[:2]
    if torch.compiler.is_compiling():
        return needed
    reached = [node is not None and torch._C._will_engine_execute_node(node) for node, _ in ctx.next_functions[:2]]
    return needed[0] and reached[0], needed[1] and reached[1]
