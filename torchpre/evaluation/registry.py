"""Evaluation during training: a registry of evaluators, each built from the job's config and run every so many
steps under the training layout, through `ParallelModel.forward_only`.

An evaluator has `due(step, last_step)` and a collective `evaluate(step)` that returns named metrics, which go into
that step's metrics record (metrics.jsonl, W&B, TensorBoard). Registered here: "validation" (the held-out loss,
`val_loss`, [validation]) and "multiple_choice" (`eval/<task>/acc` and `acc_norm` for each eval.tasks file, [eval]).
A new kind is one `register_evaluator` call.
"""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from torchpre.config.job_config import JobConfig
from torchpre.data.tokenizer import Tokenizer
from torchpre.distributed.parallel_dims import Meshes
from torchpre.evaluation.multiple_choice import MultipleChoiceEvaluator, Task
from torchpre.evaluation.validation import Validator, build_validator
from torchpre.parallel.api import Batch, ParallelModel
from torchpre.parallel.chunked_output import ChunkedProjection


class Evaluator(Protocol):
    def due(self, step: int, last_step: int) -> bool: ...

    def evaluate(self, step: int) -> dict[str, float]: ...


@dataclass(frozen=True)
class EvalContext:
    """What an evaluator is built from: the job's config, tokenizer, meshes and model, the model's forward inputs,
    the factor that turns the model's loss into a summed token loss (`loss_scale`), the multiple-choice tasks read at
    start-up (`tasks`), and context parallelism's batch cut (`shard`)."""

    config: JobConfig
    tokenizer: Tokenizer
    meshes: Meshes
    model: ParallelModel
    device: torch.device
    forward_kwargs: Callable[[torch.Tensor], dict]
    loss_scale: Callable[[], float]
    tasks: list[Task]
    vocab_size: int  # the rows of the model's embedding, which every token id of validation data must index
    shard: Callable[[Batch], Batch] | None = None
    projection: ChunkedProjection | None = None  # under training.loss_chunk_size, on the last stage's ranks


class ValidationLoss:
    """The validation loss (`Validator`) as an evaluator: `val_loss`."""

    def __init__(self, validator: Validator):
        self.validator = validator

    def due(self, step: int, last_step: int) -> bool:
        return self.validator.due(step, last_step)

    def evaluate(self, step: int) -> dict[str, float]:
        return {"val_loss": self.validator.evaluate()}


def _validation(context: EvalContext) -> list[Evaluator]:
    if not context.config.validation.enable:
        return []
    validator = build_validator(
        context.config, context.tokenizer, context.meshes.mesh, context.model,
        forward_kwargs=context.forward_kwargs, loss_scale=context.loss_scale, device=context.device,
        vocab_size=context.vocab_size, data_rank=context.meshes.data_rank(), shard=context.shard,
    )  # fmt: skip
    return [ValidationLoss(validator)]


def _multiple_choice(context: EvalContext) -> list[Evaluator]:
    e, mesh = context.config.eval, context.meshes.mesh
    return [
        MultipleChoiceEvaluator(
            task, freq=e.freq, model=context.model, device=context.device, local_batch_size=e.local_batch_size,
            max_length=e.max_length or context.config.training.seq_len, tp=mesh["tp"].size(),
            data_rank=context.meshes.data_rank(),
            groups=[mesh["dp"].get_group(), mesh["pp"].get_group()], forward_kwargs=context.forward_kwargs,
            pad_id=context.tokenizer.eos_id, samples_folder=Path(context.config.job.dump_folder) / "eval",
            projection=context.projection,
        )  # fmt: skip
        for task in context.tasks
    ]


EVALUATORS: dict[str, Callable[[EvalContext], list[Evaluator]]] = {
    "validation": _validation,
    "multiple_choice": _multiple_choice,
}


def register_evaluator(name: str, build: Callable[[EvalContext], list[Evaluator]]) -> None:
    """Adds a kind of evaluator: `build(context)` returns the job's evaluators of that kind (none when its config
    leaves it off)."""
    EVALUATORS[name] = build


class Evaluations:
    """The job's evaluators; `run` is collective."""

    def __init__(self, evaluators: list[Evaluator]):
        self.evaluators = evaluators

    def due(self, step: int, last_step: int) -> bool:
        return any(evaluator.due(step, last_step) for evaluator in self.evaluators)

    def run(self, step: int, last_step: int) -> dict[str, float]:
        """The metrics of every evaluator due at `step`."""
        results: dict[str, float] = {}
        for evaluator in self.evaluators:
            if evaluator.due(step, last_step):
                results |= evaluator.evaluate(step)
        return results


def build_evaluations(context: EvalContext) -> Evaluations:
    return Evaluations([evaluator for build in EVALUATORS.values() for evaluator in build(context)])
