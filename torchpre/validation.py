"""Evaluation on held-out data: the mean token loss over fixed validation batches, for any layout.

The validation samples are either `validation.dataset` (data of its own) or the last
`validation.split_fraction` of the training windows, which the training loader then leaves out
(`build_dataloader(held_out_fraction=...)`), so they are never trained on. A seeded order over them
defines global validation batches of `validation.local_batch_size` x DP sequences, like training's;
an evaluation is always the first `validation.steps` of them, each DP rank taking its slice. So every
evaluation sees the same samples, and a layout with the same global batch sees the same ones too.

The loss is the summed token cross-entropy over all of them divided by their token count, reduced
over DP and pipeline ranks (tensor-parallel ranks hold it replicated): the same number for any layout
up to floating-point reduction order. Evaluation runs under `torch.no_grad()` with the model in eval
mode, draws no random numbers and touches no optimizer, gradient or loader state, so training
continues exactly as it would have without it.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils.data import Dataset

from torchpre.config.job_config import JobConfig, Validation
from torchpre.data.loader import held_out_samples, source_samples
from torchpre.data.sampler import GlobalBatchSampler, SampleOrder
from torchpre.data.tokenizer import Tokenizer
from torchpre.errors import ConfigError
from torchpre.parallel.tensor_parallel import loss_parallel_context


def held_out_fraction(validation: Validation) -> float:
    """The fraction of the training data the training loader must leave out: non-zero only when
    validation is on and has no data of its own, so turning validation off never changes training."""
    return validation.split_fraction if validation.enable and not validation.dataset else 0.0


def validation_batches(
    order: SampleOrder, num_samples: int, steps: int, local_batch_size: int, dp_rank: int, dp_size: int
) -> list[list[int]]:
    """This DP rank's sample indices for each of the `steps` validation batches: the first `steps`
    global batches of `order`, sliced like training's. Rejects a set larger than the data, which would
    silently count samples twice."""
    needed = steps * local_batch_size * dp_size
    if needed > num_samples:
        raise ConfigError(
            f"validation.steps x validation.local_batch_size x data-parallel degree = {steps} x {local_batch_size} "
            f"x {dp_size} = {needed} samples per evaluation, but the validation data holds {num_samples}. Lower "
            "validation.steps or validation.local_batch_size, or give more validation data (a larger "
            "validation.split_fraction or validation.dataset_path)."
        )
    sampler = GlobalBatchSampler(order, local_batch_size, dp_rank, dp_size)
    return [next(sampler) for _ in range(steps)]


@dataclass(frozen=True)
class PipelineEval:
    """What a forward-only pass through the training pipeline schedule needs."""

    schedule: Any  # a torch.distributed.pipelining schedule, run with its `eval`
    n_microbatches: int
    has_first_stage: bool
    has_last_stage: bool
    loss_scale: float  # the schedule's loss_fn returns the summed cross-entropy divided by this


class Validator:
    """Evaluates the model on this rank's fixed validation batches; `evaluate()` is collective."""

    def __init__(
        self,
        samples: Dataset,
        batches: list[list[int]],
        *,
        freq: int,
        model_parts: list[nn.Module],
        forward: Callable[[torch.Tensor], torch.Tensor],
        loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        device: torch.device,
        groups: list[dist.ProcessGroup],
        loss_parallel: bool = False,
        pipeline: PipelineEval | None = None,
    ):
        """`forward(inputs)` gives the logits (unused under `pipeline`); `loss_sum(logits, labels)` is the
        summed token cross-entropy; `groups` are the process groups the loss is summed over (DP and PP:
        the ranks that hold different parts of it), none for one process."""
        if pipeline is not None and len(batches[0]) % pipeline.n_microbatches:
            raise ConfigError(
                f"validation.local_batch_size = {len(batches[0])}: under pipeline parallelism each validation "
                f"batch is split into the schedule's {pipeline.n_microbatches} microbatches. Use a multiple of "
                f"{pipeline.n_microbatches}."
            )
        self.samples = samples
        self.batches = batches
        self.freq = freq
        self.model_parts = model_parts
        self.forward = forward
        self.loss_sum = loss_sum
        self.device = device
        self.groups = groups
        self.loss_parallel = loss_parallel
        self.pipeline = pipeline

    def due(self, step: int, last_step: int) -> bool:
        """Evaluate every `freq` steps and after the last one."""
        return step % self.freq == 0 or step == last_step

    def evaluate(self) -> float:
        """The mean token cross-entropy over all validation batches of all DP ranks (every rank gets it)."""
        training = [part.training for part in self.model_parts]
        for part in self.model_parts:
            part.eval()
        # [summed cross-entropy, tokens]: counted where the loss is computed, so pipeline ranks without
        # the last stage add nothing. float64 so the sum over many tokens does not depend on its order.
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        try:
            with torch.no_grad(), loss_parallel_context(self.loss_parallel):
                for indices in self.batches:
                    inputs, labels = self._batch(indices)
                    loss = self._pipeline_loss_sum(inputs, labels) if self.pipeline else self._loss_sum(inputs, labels)
                    if loss is not None:
                        totals[0] += loss.double()
                        totals[1] += labels.numel()
        finally:
            for part, mode in zip(self.model_parts, training):
                part.train(mode)
        for group in self.groups:
            dist.all_reduce(totals, group=group)
        return (totals[0] / totals[1]).item()

    def _batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Stacks the samples directly: a DataLoader would draw a base seed from the global RNG."""
        pairs = [self.samples[i] for i in indices]
        inputs = torch.stack([x for x, _ in pairs]).to(self.device)
        labels = torch.stack([y for _, y in pairs]).to(self.device)
        return inputs, labels

    def _loss_sum(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return _replicated(self.loss_sum(self.forward(inputs), labels))

    def _pipeline_loss_sum(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        """One forward-only schedule run (`schedule.eval`); None on ranks without the last stage.

        The schedule's loss_fn is training's (a share of the training batch's mean), so its losses
        are scaled back to sums. `return_outputs=False` reaches `step` through `eval`'s keyword
        arguments and keeps the last stage from holding every microbatch's logits.
        """
        p = self.pipeline
        losses: list[torch.Tensor] = []
        targets = {"target": labels, "losses": losses} if p.has_last_stage else {}
        args = (inputs,) if p.has_first_stage else ()
        p.schedule.eval(*args, **targets, return_outputs=False)
        if not losses:
            return None
        return torch.stack([_replicated(loss) for loss in losses]).sum() * p.loss_scale


def build_validator(
    config: JobConfig,
    tokenizer: Tokenizer,
    mesh: DeviceMesh,
    model_parts: list[nn.Module],
    *,
    forward: Callable[[torch.Tensor], torch.Tensor],
    loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device,
    pipeline: PipelineEval | None,
) -> Validator:
    """The job's validator: its data (separate, or the held-out split of the training data) and
    this rank's batches of it, evaluated through the training model (or pipeline schedule)."""
    v, t = config.validation, config.training
    if v.dataset:
        samples, order = source_samples(
            dataset=v.dataset, dataset_path=v.dataset_path, tokenizer=tokenizer, seq_len=t.seq_len, seed=t.seed
        )
    else:
        samples, order = held_out_samples(
            dataset=t.dataset,
            dataset_path=t.dataset_path,
            dataset_mixture=t.dataset_mixture,
            tokenizer=tokenizer,
            seq_len=t.seq_len,
            seed=t.seed,
            fraction=v.split_fraction,
        )
    local_batch_size = t.local_batch_size if v.local_batch_size == -1 else v.local_batch_size
    batches = validation_batches(
        order, len(samples), v.steps, local_batch_size, mesh["dp"].get_local_rank(), mesh["dp"].size()
    )
    return Validator(
        samples,
        batches,
        freq=v.freq,
        model_parts=model_parts,
        forward=forward,
        loss_sum=loss_sum,
        device=device,
        groups=[mesh["dp"].get_group(), mesh["pp"].get_group()],
        loss_parallel=config.parallelism.enable_loss_parallel and mesh["tp"].size() > 1,
        pipeline=pipeline,
    )


def _replicated(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor for a loss that is a replicated DTensor under loss parallel."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
