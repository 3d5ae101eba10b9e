"""The baseline torchpre is measured against: a plain training loop over transformers' LlamaForCausalLM.

Same model shape (from torchpre's flavor, through its Hugging Face config export), same token
batches (torchpre's own data loader with the same seed), same AdamW hyperparameters and LR schedule
(torchpre's defaults), gradient clipping, and fp32 throughout. Each step is timed like torchpre's:
from fetching the batch to the end of the optimizer step. Prints one JSON line: median tokens/s
after the warm-up steps, the first step's loss and the parameter count.

Usage: python -m bench.hf_loop --flavor debugmodel --seq-len 256 --batch-size 8 --steps 10 --warmup 3 [--compile]
"""

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from transformers import LlamaConfig, LlamaForCausalLM

from torchpre.config.job_config import JobConfig
from torchpre.data.loader import build_dataloader
from torchpre.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer, load_tokenizer
from torchpre.models.llama3.args import LLAMA3_FLAVORS, TransformerArgs
from torchpre.models.llama3.hf import hf_config
from torchpre.optim.lr_scheduler import build_lr_scheduler

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def llama_config(args: TransformerArgs, tokenizer: Tokenizer) -> LlamaConfig:
    """The LlamaForCausalLM config of torchpre's model, via torchpre's own export (so the shapes are
    the ones its converter guarantees), with SDPA attention and no KV cache, as for training."""
    exported = hf_config(args, bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id, torch_dtype="float32")
    return LlamaConfig(**exported, attn_implementation="sdpa", use_cache=False)


def build_optimizer(model: nn.Module, job: JobConfig, steps: int) -> tuple[torch.optim.AdamW, LambdaLR]:
    """torchpre's AdamW and schedule: decay on matrices only (norm gains undecayed, as torchpre does)."""
    o, s = job.optimizer, job.lr_scheduler
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    scheduler = build_lr_scheduler(
        optimizer,
        steps=steps,
        warmup_steps=s.warmup_steps,
        decay_ratio=s.decay_ratio,
        decay_type=s.decay_type,
        min_lr_factor=s.min_lr_factor,
    )
    return optimizer, scheduler


def loss_fn(model: LlamaForCausalLM, compile_model: bool) -> LossFn:
    """Mean token cross-entropy on the model's logits; compiled together with the model when asked,
    which gives the baseline one whole-model graph (torchpre compiles per block)."""

    def loss(inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=inputs).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    return torch.compile(loss) if compile_model else loss


def train(flavor: str, seq_len: int, batch_size: int, steps: int, warmup: int, compile_model: bool) -> dict:
    """Trains `steps` steps and returns the steady tokens/s, the first loss and the parameter count."""
    if steps <= warmup:
        raise ValueError(f"no steps after the {warmup} warm-up steps; run more steps")
    job = JobConfig()
    t = job.training
    tokenizer = load_tokenizer(DEFAULT_TOKENIZER_PATH)
    args = dataclasses.replace(LLAMA3_FLAVORS[flavor], vocab_size=tokenizer.vocab_size, max_seq_len=seq_len)
    torch.manual_seed(t.seed)
    model = LlamaForCausalLM(llama_config(args, tokenizer)).train()
    optimizer, scheduler = build_optimizer(model, job, steps)
    loss_of = loss_fn(model, compile_model)
    loader = build_dataloader(
        dataset=t.dataset,
        dataset_path=t.dataset_path,
        tokenizer=tokenizer,
        seq_len=seq_len,
        local_batch_size=batch_size,
        global_batch_size=batch_size,
        dp_rank=0,
        dp_size=1,
        seed=t.seed,
        vocab_size=model.config.vocab_size,
    )
    batches = iter(loader)
    step_times, losses = [], []
    for _ in range(steps):
        start = time.perf_counter()
        inputs, labels = next(batches)
        loss = loss_of(inputs, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return {
        "tokens_per_sec": statistics.median(batch_size * seq_len / s for s in step_times[warmup:]),
        "first_loss": losses[0],
        "num_params": sum(p.numel() for p in model.parameters()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", required=True, choices=sorted(LLAMA3_FLAVORS))
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model and loss")
    a = parser.parse_args()
    print(json.dumps(train(a.flavor, a.seq_len, a.batch_size, a.steps, a.warmup, a.compile)), flush=True)


if __name__ == "__main__":
    main()
