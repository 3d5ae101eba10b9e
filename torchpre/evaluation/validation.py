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

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import Dataset

from torchpre.config.job_config import JobConfig, Validation
from torchpre.data.loader import held_out_samples, source_samples
from torchpre.data.sampler import GlobalBatchSampler, SampleOrder
from torchpre.data.tokenizer import Tokenizer
from torchpre.errors import ConfigError, resolve_step
from torchpre.parallel.api import Batch, ParallelModel
from torchpre.parallel.pipeline import PipelinePlan
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


@contextlib.contextmanager
def eval_mode(model: ParallelModel) -> Iterator[None]:
    """The model's parts in eval mode for the block, then back in the mode each was in."""
    training = [part.training for part in model.parts]
    for part in model.parts:
        part.eval()
    try:
        yield
    finally:
        for part, mode in zip(model.parts, training):
            part.train(mode)


class Validator:
    """Evaluates the model on this rank's fixed validation batches; `evaluate()` is collective."""

    def __init__(
        self,
        samples: Dataset,
        batches: list[list[int]],
        *,
        freq: int,
        model: ParallelModel,
        device: torch.device,
        groups: list[dist.ProcessGroup],
        forward_kwargs: Callable[[torch.Tensor], dict] = lambda inputs: {},
        loss_scale: Callable[[], float] = lambda: 1.0,
        loss_parallel: bool = False,
        shard: Callable[[Batch], Batch] | None = None,
    ):
        """`model.forward_only(inputs, labels)` gives its loss_fn's value, which times `loss_scale()` (read at each
        evaluation: a global-batch ramp or a data stage changes the loss_fn's divisor) is the
        summed token cross-entropy; `groups` are the process groups the loss is summed over (DP and PP: the
        ranks that hold different parts of it), none for one process. `shard` cuts each batch to this rank's
        positions under context parallelism (its tokens are then counted here, and the cp ranks' sums add up
        over the DP group, which spans them)."""
        pipeline = model.plan.pipeline
        assert pipeline is None or len(batches[0]) % pipeline.n_microbatches == 0, "check_validation_batches"
        self.samples = samples
        self.batches = batches
        self.freq = freq
        self.model = model
        self.device = device
        self.groups = groups
        self.forward_kwargs = forward_kwargs
        self.loss_scale = loss_scale
        self.loss_parallel = loss_parallel
        self.shard = shard

    def due(self, step: int, last_step: int) -> bool:
        """Evaluate every `freq` steps and after the last one."""
        return step % self.freq == 0 or step == last_step

    def evaluate(self) -> float:
        """The mean token cross-entropy over all validation batches of all DP ranks (every rank gets it)."""
        # [summed cross-entropy, tokens]: counted where the loss is computed, so pipeline ranks without
        # the last stage add nothing. float64 so the sum over many tokens does not depend on its order.
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        with eval_mode(self.model), loss_parallel_context(self.loss_parallel):
            for indices in self.batches:
                inputs, labels = self._batch(indices)
                loss = self.model.forward_only(inputs, labels, self.forward_kwargs)
                if loss is not None:
                    totals[0] += loss.double() * self.loss_scale()
                    totals[1] += labels.numel()
        for group in self.groups:
            dist.all_reduce(totals, group=group)
        return (totals[0] / totals[1]).item()

    def _batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Stacks the samples directly: a DataLoader would draw a base seed from the global RNG."""
        pairs = [self.samples[i] for i in indices]
        inputs = torch.stack([x for x, _ in pairs]).to(self.device)
        labels = torch.stack([y for _, y in pairs]).to(self.device)
        return (inputs, labels) if self.shard is None else self.shard((inputs, labels))


@resolve_step
def check_validation_batches(config: JobConfig, pipeline: PipelinePlan | None) -> None:
    """Under pipeline parallelism each validation batch runs as the schedule's microbatches, which must divide it."""
    v = config.validation
    if not v.enable or pipeline is None:
        return
    local_batch_size = config.training.local_batch_size if v.local_batch_size == -1 else v.local_batch_size
    if local_batch_size % pipeline.n_microbatches:
        raise ConfigError(
            f"validation.local_batch_size = {local_batch_size}: under pipeline parallelism each validation "
            f"batch is split into the schedule's {pipeline.n_microbatches} microbatches. Use a multiple of "
            f"{pipeline.n_microbatches}."
        )


def build_validator(
    config: JobConfig,
    tokenizer: Tokenizer,
    mesh: DeviceMesh,
    model: ParallelModel,
    *,
    forward_kwargs: Callable[[torch.Tensor], dict],
    loss_scale: Callable[[], float],
    device: torch.device,
    vocab_size: int,
    data_rank: tuple[int, int] | None = None,
    shard: Callable[[Batch], Batch] | None = None,
) -> Validator:
    """The job's validator: its data (separate, or the held-out split of the training data, its token ids checked
    against the model's `vocab_size` embedding rows) and this rank's batches of it, evaluated through the training
    model (or pipeline schedule). `data_rank` (this rank's data-parallel coordinate and degree; default `mesh`'s
    "dp") and `shard` for context parallelism, whose ranks read the same sequences (`Meshes.data_rank`,
    `ContextParallel.shard`)."""
    v, t = config.validation, config.training
    if v.dataset:
        samples, order = source_samples(
            dataset=v.dataset, dataset_path=v.dataset_path, tokenizer=tokenizer, seq_len=t.seq_len, seed=t.seed,
            vocab_size=vocab_size,
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
            vocab_size=vocab_size,
        )
    local_batch_size = t.local_batch_size if v.local_batch_size == -1 else v.local_batch_size
    dp_rank, dp_size = data_rank or (mesh["dp"].get_local_rank(), mesh["dp"].size())
    batches = validation_batches(order, len(samples), v.steps, local_batch_size, dp_rank, dp_size)
    return Validator(
        samples,
        batches,
        freq=v.freq,
        model=model,
        device=device,
        groups=[mesh["dp"].get_group(), mesh["pp"].get_group()],
        forward_kwargs=forward_kwargs,
        loss_scale=loss_scale,
        loss_parallel=config.parallelism.enable_loss_parallel and mesh["tp"].size() > 1,
        shard=shard,
    )

