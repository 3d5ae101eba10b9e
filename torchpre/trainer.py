"""The training loop, assembled from the config: model, data, optimizer, parallelism, metrics."""

import dataclasses
import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from torchpre.config.job_config import JobConfig
from torchpre.config.parser import to_toml
from torchpre.config.validate import validate_config
from torchpre.data.loader import build_dataloader
from torchpre.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer
from torchpre.distributed.parallel_dims import ParallelDims
from torchpre.distributed.utils import init_distributed, select_device, world_size_from_env
from torchpre.errors import ConfigError
from torchpre.metrics.flops import peak_flops
from torchpre.metrics.logger import MetricsLogger
from torchpre.metrics.memory import max_memory_bytes
from torchpre.models.registry import get_flavor, get_model_spec
from torchpre.optim.lr_scheduler import build_lr_scheduler
from torchpre.optim.optimizer import build_optimizer
from torchpre.parallel.data_parallel import all_reduce_gradients

logger = logging.getLogger("torchpre")

IGNORE_INDEX = -100


def resolve_batch_sizes(local_batch_size: int, global_batch_size: int, dp: int) -> tuple[int, int]:
    """(global batch size, gradient-accumulation steps) for `training.global_batch_size`."""
    per_round = local_batch_size * dp
    if global_batch_size == -1:
        return per_round, 1
    if global_batch_size % per_round:
        raise ConfigError(
            f"training.global_batch_size = {global_batch_size} is not divisible by training.local_batch_size x "
            f"data-parallel degree = {local_batch_size} x {dp} = {per_round}. Use a multiple of {per_round} "
            "(or -1 for exactly one microbatch per rank)."
        )
    return global_batch_size, global_batch_size // per_round


class Trainer:
    """Owns one training job: builds its pieces from a JobConfig, then `train()` runs the steps.

    Everything that can reject the config (values, layout, batch arithmetic, model names, files)
    runs before the process group is joined, identically on every rank, so bad input stops every
    rank with the same message instead of leaving some waiting for a peer.
    """

    def __init__(self, config: JobConfig):
        validate_config(config)
        t = config.training
        self.config = config
        self.parallel_dims = ParallelDims.from_degrees(
            config.parallelism.data_parallel_degree,
            config.parallelism.tensor_parallel_degree,
            config.parallelism.pipeline_parallel_degree,
            world_size_from_env(),
        )
        if self.parallel_dims.tp > 1 or self.parallel_dims.pp > 1:
            raise ConfigError(
                "Tensor and pipeline parallelism are not available yet: set parallelism.tensor_parallel_degree "
                "and parallelism.pipeline_parallel_degree to 1."
            )
        self.global_batch_size, self.accumulation_steps = resolve_batch_sizes(
            t.local_batch_size, t.global_batch_size, self.parallel_dims.dp
        )
        self.model_spec = get_model_spec(config.model.name)
        flavor_args = get_flavor(self.model_spec, config.model.flavor)
        self.tokenizer = Tokenizer(config.model.tokenizer_path or DEFAULT_TOKENIZER_PATH)
        self.model_args = dataclasses.replace(flavor_args, vocab_size=self.tokenizer.vocab_size, max_seq_len=t.seq_len)

        self.device = select_device()
        init_distributed(self.device)
        self.mesh = self.parallel_dims.build_mesh(self.device.type)
        self.dp_mesh = self.mesh["dp"]
        self.is_logging_rank = dist.get_rank() == 0
        torch.manual_seed(t.seed)

        self.dataloader = build_dataloader(
            dataset=t.dataset,
            dataset_path=t.dataset_path,
            tokenizer=self.tokenizer,
            seq_len=t.seq_len,
            local_batch_size=t.local_batch_size,
            global_batch_size=self.global_batch_size,
            dp_rank=self.dp_mesh.get_local_rank(),
            dp_size=self.parallel_dims.dp,
            seed=t.seed,
        )
        self.model = self._build_model()
        o, s = config.optimizer, config.lr_scheduler
        self.optimizer = build_optimizer(
            self.model, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay
        )
        self.lr_scheduler = build_lr_scheduler(
            self.optimizer,
            steps=t.steps,
            warmup_steps=s.warmup_steps,
            decay_ratio=s.decay_ratio,
            decay_type=s.decay_type,
            min_lr_factor=s.min_lr_factor,
        )
        self.step = 0
        self.metrics = MetricsLogger(config.job.dump_folder) if self.is_logging_rank else None
        self._save_resolved_config()

    def _build_model(self) -> torch.nn.Module:
        """Builds on the meta device, then materialises and initialises from the seed alone."""
        with torch.device("meta"):
            model = self.model_spec.model_cls(self.model_args)
        model.to_empty(device=self.device)
        model.init_weights(self.config.training.seed)
        self.num_params = sum(p.numel() for p in model.parameters())
        self.flops_per_token = self.model_spec.flops_per_token(
            self.model_args, self.num_params, self.config.training.seq_len
        )
        logger.info(
            "model %s %s: %s parameters, %s FLOPs/token, layout %s, global batch %d (%d microbatches per rank)",
            self.config.model.name,
            self.config.model.flavor,
            f"{self.num_params:,}",
            f"{self.flops_per_token:,}",
            self.parallel_dims,
            self.global_batch_size,
            self.accumulation_steps,
        )
        return model

    def _save_resolved_config(self) -> None:
        if not self.is_logging_rank:
            return
        text = to_toml(self.config)
        logger.info("resolved config:\n%s", text)
        path = Path(self.config.job.dump_folder) / "config.toml"
        path.write_text(text, encoding="utf-8")

    def train(self) -> None:
        t = self.config.training
        peak = peak_flops(self.device, self.config.metrics.peak_flops)
        batches = iter(self.dataloader)
        interval_start, interval_steps, data_time = time.perf_counter(), 0, 0.0
        while self.step < t.steps:
            fetch_start = time.perf_counter()
            microbatches = [next(batches) for _ in range(self.accumulation_steps)]
            data_time += time.perf_counter() - fetch_start
            lr = self.lr_scheduler.get_last_lr()[0]
            loss_sum, num_tokens, grad_norm = self.train_step(microbatches)
            self.step += 1
            interval_steps += 1
            if self.step % self.config.metrics.log_freq == 0 or self.step == t.steps:
                elapsed = time.perf_counter() - interval_start
                self._log(loss_sum, num_tokens, grad_norm, lr, elapsed / interval_steps, data_time / interval_steps, peak)
                interval_start, interval_steps, data_time = time.perf_counter(), 0, 0.0
        if self.metrics is not None:
            self.metrics.close()

    def train_step(
        self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One optimizer step over this rank's microbatches.

        Returns (this rank's summed token loss, global token count, global grad norm before clipping).
        Each microbatch's summed loss is divided by the global token count before backward, so the
        accumulated, DP-summed gradient is that of the mean loss over the whole global batch.
        """
        microbatches = [(x.to(self.device), y.to(self.device)) for x, y in microbatches]
        num_tokens = sum((y != IGNORE_INDEX).sum() for _, y in microbatches)
        dist.all_reduce(num_tokens, group=self.dp_mesh.get_group())
        loss_sum = torch.zeros((), device=self.device)
        for inputs, labels in microbatches:
            logits = self.model(inputs)
            loss = F.cross_entropy(
                logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX
            )
            (loss / num_tokens).backward()
            loss_sum += loss.detach()
        all_reduce_gradients(self.model.parameters(), self.dp_mesh.get_group())
        max_norm = self.config.training.max_norm or math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, num_tokens, grad_norm

    def _log(
        self,
        loss_sum: torch.Tensor,
        num_tokens: torch.Tensor,
        grad_norm: torch.Tensor,
        lr: float,
        step_time: float,
        data_time: float,
        peak: float,
    ) -> None:
        """Gathers the global loss and the per-rank maxima, then rank 0 writes the record."""
        dist.all_reduce(loss_sum, group=self.dp_mesh.get_group())
        maxima = torch.tensor(
            [max_memory_bytes(self.device), self._optimizer_state_bytes()], dtype=torch.float64, device=self.device
        )
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        if self.metrics is None:
            return
        tokens_per_step = self.global_batch_size * self.config.training.seq_len
        tokens_per_sec = tokens_per_step / step_time
        world_size = self.parallel_dims.world_size
        self.metrics.log(
            {
                "step": self.step,
                "loss": (loss_sum / num_tokens).item(),
                "lr": lr,
                "grad_norm": grad_norm.item(),
                "tokens_per_sec": tokens_per_sec,
                "tokens_per_sec_per_device": tokens_per_sec / world_size,
                "mfu": self.flops_per_token * tokens_per_sec / (peak * world_size),
                "step_time_s": step_time,
                "data_time_s": data_time,
                "max_memory_bytes": int(maxima[0]),
                "optimizer_state_bytes": int(maxima[1]),
            }
        )

    def _optimizer_state_bytes(self) -> int:
        return sum(
            value.nbytes
            for state in self.optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        )
