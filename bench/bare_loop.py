"""The floor a training loop's per-step host overhead is measured against: a bare PyTorch loop over torchpre's own
Llama 3 model (same flavor, init, tokens, AdamW hyperparameters and schedule as train.py), with nothing a real
run needs beyond the step itself: forward, the mean token cross-entropy, backward, clipping to the global norm,
AdamW (foreach) and the LR step, and the loss read on the host every step (as logging every step does).

    python -m bench.bare_loop --flavor tiny --seq-len 64 --batch-size 8 --steps 300
"""

import argparse
import dataclasses

import torch
import torch.nn.functional as F

from torchpre.data.synthetic import SyntheticTokens
from torchpre.models.llama3.args import LLAMA3_FLAVORS
from torchpre.models.llama3.model import Transformer
from torchpre.optim.lr_scheduler import build_lr_scheduler


def train(flavor: str, seq_len: int, batch_size: int, steps: int, vocab_size: int = 2048, seed: int = 42) -> float:
    """Trains `steps` steps; returns the last loss."""
    torch.manual_seed(seed)
    args = dataclasses.replace(LLAMA3_FLAVORS[flavor], vocab_size=vocab_size, max_seq_len=seq_len)
    model = Transformer(args)
    model.init_weights(seed)
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}],
        lr=8e-4, betas=(0.9, 0.95), eps=1e-8, foreach=True,
    )  # fmt: skip
    scheduler = build_lr_scheduler(
        optimizer, steps=steps, warmup_steps=10, decay_ratio=1.0, decay_type="linear", min_lr_factor=0.0
    )
    tokens = SyntheticTokens(seq_len, vocab_size, seed)
    position, loss_value = 0, float("nan")
    for _ in range(steps):
        inputs, labels = (torch.stack(part) for part in zip(*(tokens[position + i] for i in range(batch_size))))
        position += batch_size
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()
    return loss_value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="tiny")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300)
    options = parser.parse_args()
    torch.set_num_threads(1)
    print(f"final loss {train(options.flavor, options.seq_len, options.batch_size, options.steps)!r}")


if __name__ == "__main__":
    main()
