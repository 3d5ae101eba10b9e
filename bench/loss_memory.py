"""The loss's peak memory and time, forward and backward, with the whole logits and chunk by chunk
(training.loss_chunk_size), on one CPU thread.

For each vocabulary and sequence length: the output projection of one sequence's final hidden states [seq, dim] and
its summed token cross-entropy, then the backward to the hidden states and the weight, fp32, in three ways:

- full: today's path without chunking, `F.linear` then torchpre's `cross_entropy_sum` (fp32 logits, log-softmax);
- chunked: `torchpre.parallel.linear_cross_entropy`, what training.loss_chunk_size runs (each chunk's logits
  recomputed in the backward);
- in forward: the measured alternative, both gradients computed during the forward chunk by chunk and held until
  the backward (Liger-Kernel's fused linear cross-entropy, written here in PyTorch).

Peak is the tensor counter's (`TensorMemory`: every storage the ops create, the two gradients included) above what
existed before; time the process's CPU seconds (which another process's load on a shared machine does not inflate as
it does wall time), the fewest of --repeats runs, the three ways interleaved. Each row also checks the chunked loss
against the full one. The default rows include a 128,256-token vocabulary at 8,192 tokens, whose full logits need
about 13 GiB; --quick runs one small row (for tests).

Usage: python -m bench.loss_memory [--dim 256] [--chunk-size 1024] [--repeats 2] [--quick]
"""

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from bench.common import print_table
from torchpre.parallel.linear_cross_entropy import linear_cross_entropy
from torchpre.planner.tensor_memory import TensorMemory
from torchpre.training.loss import cross_entropy_sum

GiB = 2**30
VOCABS = (2048, 32768, 128256)
SEQ_LENS = (4096, 8192)
QUICK = ((2048, 512),)


class _GradientsInForward(torch.autograd.Function):
    """The alternative to recomputing: each chunk's logits give both gradients during the forward (fp32), which the
    backward scales by the loss's gradient."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, chunk_size: int) -> Tensor:
        total = torch.zeros((), dtype=torch.float32)
        grad_hidden, grad_weight = torch.empty_like(hidden), torch.zeros(weight.shape, dtype=torch.float32)
        for start in range(0, len(labels), chunk_size):
            rows = slice(start, start + chunk_size)
            logits = (hidden[rows] @ weight.T).float()
            log_normalizer = torch.logsumexp(logits, dim=1)
            total += (log_normalizer - logits.gather(1, labels[rows, None]).squeeze(1)).sum()
            probs = logits.sub_(log_normalizer[:, None]).exp_()
            probs.scatter_add_(1, labels[rows, None], torch.full((len(probs), 1), -1.0))
            grad_hidden[rows] = probs.to(weight.dtype) @ weight
            grad_weight.addmm_(probs.T, hidden[rows].float())
            del logits, probs
        ctx.save_for_backward(grad_hidden, grad_weight)
        return total

    @staticmethod
    def backward(ctx, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss, grad_weight * grad_loss, None, None


def full(hidden: Tensor, weight: Tensor, labels: Tensor, chunk_size: int) -> Tensor:
    return cross_entropy_sum(F.linear(hidden, weight)[None], labels[None])


WAYS: dict[str, Callable[[Tensor, Tensor, Tensor, int], Tensor]] = {
    "full": full,
    "chunked": linear_cross_entropy,
    "in forward": _GradientsInForward.apply,
}


@dataclass(frozen=True)
class Row:
    vocab: int
    seq_len: int
    peak_bytes: dict[str, int]
    seconds: dict[str, float]
    loss_error: float  # |chunked - full| / full


def measure_once(
    way: Callable, hidden: Tensor, weight: Tensor, labels: Tensor, chunk_size: int
) -> tuple[int, float, Tensor]:
    """One forward and backward: the peak bytes above the start, the CPU seconds, the loss."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with TensorMemory(("cpu",)) as memory:
        memory.begin_step()
        start = time.process_time()
        loss = way(h, w, labels, chunk_size)
        loss.backward()
        seconds = time.process_time() - start
    return memory.peak - memory.step_start, seconds, loss.detach()


def measure(vocab: int, seq_len: int, dim: int, chunk_size: int, repeats: int) -> Row:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(seq_len, dim, generator=generator)
    weight = torch.randn(vocab, dim, generator=generator) * dim**-0.5
    labels = torch.randint(0, vocab, (seq_len,), generator=generator)
    peaks: dict[str, int] = {}
    seconds: dict[str, float] = {name: float("inf") for name in WAYS}
    losses: dict[str, Tensor] = {}
    for _ in range(repeats):
        for name, way in WAYS.items():
            peaks[name], took, losses[name] = measure_once(way, hidden, weight, labels, chunk_size)
            seconds[name] = min(seconds[name], took)
    error = ((losses["chunked"] - losses["full"]).abs() / losses["full"].abs()).item()
    return Row(vocab, seq_len, peaks, seconds, error)


def run(dim: int, chunk_size: int, repeats: int, quick: bool) -> list[Row]:
    """Every row, each reported on stderr as it is measured (the 128K rows take minutes)."""
    rows = []
    for vocab, seq_len in QUICK if quick else [(vocab, seq_len) for vocab in VOCABS for seq_len in SEQ_LENS]:
        rows.append(measure(vocab, seq_len, dim, chunk_size, repeats))
        print(f"measured vocab {vocab}, seq {seq_len}: {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=256, help="hidden size (the debug model's; 1B's is 2048)")
    parser.add_argument("--chunk-size", type=int, default=1024, help="training.loss_chunk_size")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="one small row, for tests")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = run(args.dim, args.chunk_size, args.repeats, args.quick)
    print_table(
        f"The loss's forward and backward, one sequence, dim {args.dim}, fp32, {args.chunk_size} tokens per chunk",
        ["vocab", "seq", "full GiB", "chunked GiB", "in forward GiB", "chunked / full", "full CPU s",
         "chunked CPU s", "in forward CPU s", "chunked / full", "loss rel. diff"],
        [[f"{r.vocab:,}", f"{r.seq_len:,}", *(f"{r.peak_bytes[w] / GiB:.3f}" for w in WAYS),
          f"{r.peak_bytes['chunked'] / r.peak_bytes['full']:.3f}", *(f"{r.seconds[w]:.2f}" for w in WAYS),
          f"{r.seconds['chunked'] / r.seconds['full']:.2f}", f"{r.loss_error:.1e}"] for r in rows],
    )  # fmt: skip


if __name__ == "__main__":
    main()
