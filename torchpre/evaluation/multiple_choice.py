"""Multiple-choice tasks scored by log-likelihood, as lm-evaluation-harness scores HellaSwag, ARC or PIQA.

A task is a JSONL file, one question a line: `{"context": str, "choices": [str, ...], "answer": int}`. Each choice
is scored by the summed log-probability of its tokens after the context: the continuation is `" " + choice`
(lm-evaluation-harness's default `target_delimiter`), tokenized as lm-evaluation-harness does (the tokens of
`context + continuation` after those of `context`, a trailing space of the context moved to the continuation),
after the BOS token every training document starts with (none for a family without one, such as Qwen's). `acc`
counts the questions whose answer has the highest log-likelihood; `acc_norm` ranks the choices by log-likelihood
divided by the choice's length in characters (lm-evaluation-harness's `acc_norm`:
`np.argmax(lls / [len(choice) for choice in choices])`).

Every (question, choice) pair is one row of at most `max_length` + 1 tokens (eval.max_length, 0 = training.seq_len):
a longer one keeps its last ones and the model reads all but the last, lm-evaluation-harness's window
(`(context_enc + continuation_enc)[-(max_length + 1):][:-1]`). A batch is padded at the end to its longest row,
rounded up to a multiple of `PAD_MULTIPLE` and of the tensor-parallel degree (sequence parallel splits positions)
but never past `max_length`: rows are far shorter than training's sequences, and the logits are only turned into
log-probabilities at the choices' positions, so an evaluation costs little memory. The rows are dealt to the
data-parallel ranks in global batches like validation's; each rank scores its rows through
`ParallelModel.forward_only` (under pipeline parallelism the last stage's logits, the activations passed stage to
stage), and the log-likelihoods are summed over the data-parallel and pipeline ranks, so every rank holds all of them
and computes the same accuracy.
"""

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchpre.confined import make_folder, open_named, write_file
from torchpre.data.tokenizer import Tokenizer
from torchpre.errors import ConfigError, FieldError, InputFileError, UntrustedInput, json_field, resolve_step
from torchpre.evaluation.validation import eval_mode
from torchpre.json_input import JsonValue, json_lines
from torchpre.parallel.api import ParallelModel
from torchpre.parallel.chunked_output import ChunkedProjection

TARGET_DELIMITER = " "
PAD_MULTIPLE = 64  # few distinct batch shapes, for compiled models


@dataclass(frozen=True)
class Question:
    context: str
    choices: list[str]
    answer: int
    where: str = ""  # "file:line", for errors


@dataclass(frozen=True)
class Row:
    """One (question, choice) pair: its tokens and how many of the last ones are the choice's."""

    tokens: list[int]
    continuation_length: int


@dataclass(frozen=True)
class Task:
    """A task file read and tokenized: its name (the file name without .jsonl), questions and rows (question by
    question, choice by choice)."""

    name: str
    path: Path
    questions: list[Question]
    rows: list[Row]


def task_name(path: str | Path) -> str:
    return Path(path).name.removesuffix(".jsonl")


def read_questions(path: Path) -> list[Question]:
    """The questions of a task file; an InputFileError naming `file:line` and what is wrong for a malformed line. Task
    files are often downloaded: each line is bounded before it is parsed (`json_input.json_lines`), and the file
    must be a regular file (the path is the user's: a link on it is followed, `confined.open_named`)."""
    try:
        file = open_named(path)
    except FileNotFoundError:
        raise ConfigError(
            f"eval.tasks: {path} does not exist. Give JSONL files of multiple-choice questions."
        ) from None
    except UntrustedInput as error:
        raise UntrustedInput(f"eval.tasks: {error}") from None
    with file:
        try:
            questions = [_question(record, f"{path}:{number}") for number, record in json_lines(file, path)]
        except UntrustedInput as error:
            raise UntrustedInput(f"eval.tasks: {error} Each line must be a JSON object like {_EXPECTED}.") from None
    if not questions:
        raise InputFileError(f"eval.tasks: {path} holds no questions (one JSON object a line).")
    return questions


_EXPECTED = '{"context": str, "choices": [str, ...], "answer": int}'


def _question(record: JsonValue, where: str) -> Question:
    expected = f"expected {_EXPECTED}"
    try:
        context = json_field(record, "context", str)
        choices = json_field(record, "choices", list)
        answer = json_field(record, "answer", int)
    except FieldError as error:
        raise InputFileError(f"eval.tasks: {where}: {error}; {expected}.") from None
    if len(choices) < 2 or not all(isinstance(choice, str) and choice for choice in choices):
        raise InputFileError(f"eval.tasks: {where}: 'choices' must hold at least two non-empty strings; {expected}.")
    if not 0 <= answer < len(choices):
        raise InputFileError(
            f"eval.tasks: {where}: 'answer' = {answer} is not an index into its {len(choices)} choices (0 to "
            f"{len(choices) - 1})."
        )
    return Question(context, choices, answer, where)


def encode_pair(tokenizer: Tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-evaluation-harness's `_encode_pair`: trailing spaces of the context go to the continuation, whose tokens are
    those of the whole text after the context's. The context starts as a training document does (its BOS, where the
    tokenizer's family adds one: lm-evaluation-harness's `add_bos_token`); a context that leaves empty gets
    lm-evaluation-harness's prefix token, EOS, so that the first choice token has one to follow."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, bos=True, eos=False)
    context_ids = tokenizer.encode(context, bos=True, eos=False)
    return context_ids or [tokenizer.eos_id], whole[len(context_ids) :]


@cache
def read_task(path: str, tokenizer: Tokenizer, max_length: int) -> Task:
    """A task file's questions and rows of at most `max_length` + 1 tokens; a choice whose tokens alone exceed
    `max_length` is an error naming its line. Read once per process (the planner checks many layouts of one job, each
    through start-up's checks)."""
    questions = read_questions(Path(path))
    rows = []
    for question in questions:
        for choice in question.choices:
            context, continuation = encode_pair(tokenizer, question.context, TARGET_DELIMITER + choice)
            if len(continuation) > max_length:
                raise ConfigError(
                    f"eval.tasks: {question.where}: the choice {choice!r} is {len(continuation)} tokens, more than "
                    f"the {max_length} the model reads of a row (eval.max_length; 0 = training.seq_len): shorten "
                    "it, or raise eval.max_length."
                )
            rows.append(Row((context + continuation)[-(max_length + 1) :], len(continuation)))
    return Task(task_name(path), Path(path), questions, rows)


@resolve_step
def read_tasks(paths: list[str], tokenizer: Tokenizer, max_length: int) -> list[Task]:
    """Every eval.tasks file, read before any work; two files of the same name are an error (their metrics would
    mix)."""
    names = [task_name(path) for path in paths]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ConfigError(
            f"eval.tasks: two files are named '{twice[0]}.jsonl'; each task's metrics are named by its file, so "
            "give them different names."
        )
    return [read_task(path, tokenizer, max_length) for path in paths]


def accuracies(questions: list[Question], lls: list[float]) -> dict[str, float]:
    """`acc` and `acc_norm` from every row's log-likelihood (question by question, choice by choice)."""
    correct = correct_norm = 0
    start = 0
    for question in questions:
        scores = lls[start : start + len(question.choices)]
        start += len(question.choices)
        normalised = [score / len(choice) for score, choice in zip(scores, question.choices)]
        correct += _argmax(scores) == question.answer
        correct_norm += _argmax(normalised) == question.answer
    return {"acc": correct / len(questions), "acc_norm": correct_norm / len(questions)}


def _argmax(values: list[float]) -> int:
    """The first index of the largest value (numpy's argmax, which lm-evaluation-harness uses)."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


class MultipleChoiceEvaluator:
    """Scores one task every `freq` steps under the training layout; `evaluate` is collective. Rank 0 writes each
    question's log-likelihoods to `{samples_folder}/{task}/step-N.jsonl` (lm-evaluation-harness's --log_samples), a
    new file renamed into place in a folder that is no symbolic link (`torchpre.confined`)."""

    def __init__(
        self,
        task: Task,
        *,
        freq: int,
        model: ParallelModel,
        device: torch.device,
        local_batch_size: int,
        max_length: int,
        tp: int,
        data_rank: tuple[int, int],
        groups: list[dist.ProcessGroup],
        forward_kwargs: Callable[[torch.Tensor], dict],
        pad_id: int,
        samples_folder: Path | None,
        projection: ChunkedProjection | None = None,
    ):
        self.task, self.freq, self.model, self.device = task, freq, model, device
        self.projection = projection  # the last stage's chunked output layer, under training.loss_chunk_size
        self.local_batch_size, self.max_length = local_batch_size, max_length
        self.pad_multiple = math.lcm(PAD_MULTIPLE, tp)
        self.dp_rank, self.dp_size = data_rank
        self.groups, self.forward_kwargs, self.pad_id = groups, forward_kwargs, pad_id
        self.samples_folder = samples_folder

    def due(self, step: int, last_step: int) -> bool:
        return step % self.freq == 0 or step == last_step

    def evaluate(self, step: int) -> dict[str, float]:
        lls = self.log_likelihoods()
        results = accuracies(self.task.questions, lls)
        if self.samples_folder is not None:
            self._write_samples(step, lls)
        return {f"eval/{self.task.name}/{metric}": value for metric, value in results.items()}

    def log_likelihoods(self) -> list[float]:
        """Every row's log-likelihood of its choice, on every rank."""
        rows = len(self.task.rows)
        per_batch = self.local_batch_size * self.dp_size
        lls = torch.zeros(rows, dtype=torch.float64, device=self.device)
        with eval_mode(self.model):
            for first in range(0, rows, per_batch):  # the same number of forward passes on every rank
                start = first + self.dp_rank * self.local_batch_size
                indices = list(range(start, min(start + self.local_batch_size, rows)))
                inputs, targets, mask = self._batch(indices)
                output = self.model.forward_only(inputs, forward_kwargs=self.forward_kwargs)
                if output is not None:  # also without rows: a chunked projection may gather its weight over ZeRO-3
                    scores = _continuation_log_likelihoods(output, targets, mask, self.projection)
                    lls[indices] = scores[: len(indices)]
        for group in self.groups:
            dist.all_reduce(lls, group=group)
        return lls.tolist()

    def _batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Inputs, targets and the mask of the choice's target positions; rows past the task's end are padding."""
        longest = max((len(self.task.rows[index].tokens) - 1 for index in indices), default=1)
        length = min(-(-longest // self.pad_multiple) * self.pad_multiple, self.max_length)
        shape = (self.local_batch_size, length)
        inputs = torch.full(shape, self.pad_id, dtype=torch.long)
        targets = torch.full(shape, self.pad_id, dtype=torch.long)
        mask = torch.zeros(shape, dtype=torch.bool)
        for i, index in enumerate(indices):
            row = self.task.rows[index]
            n = len(row.tokens) - 1
            inputs[i, :n] = torch.tensor(row.tokens[:-1])
            targets[i, :n] = torch.tensor(row.tokens[1:])
            mask[i, n - row.continuation_length : n] = True
        return inputs.to(self.device), targets.to(self.device), mask.to(self.device)

    def _write_samples(self, step: int, lls: list[float]) -> None:
        if dist.get_rank() != 0:
            return
        folder = make_folder(self.samples_folder, self.task.name)
        start, lines = 0, []
        for question in self.task.questions:
            scores = lls[start : start + len(question.choices)]
            start += len(question.choices)
            lines.append(json.dumps({"answer": question.answer, "log_likelihoods": scores}) + "\n")
        write_file(folder / f"step-{step}.jsonl", "".join(lines))


def _continuation_log_likelihoods(
    output: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, projection: ChunkedProjection | None = None
) -> torch.Tensor:
    """Per row, the summed log-probability of the masked targets, in float64, taken at those positions only: from the
    logits (vocab-sharded ones gathered first), or under training.loss_chunk_size from the hidden states the model
    returns (each tensor-parallel rank's whole), projected chunk by chunk by `projection`."""
    rows = mask.nonzero()[:, 0]
    if projection is not None:
        hidden = output.to_local() if isinstance(output, DTensor) else output
        picked = projection.log_probs(hidden[mask], targets[mask]).double()
    else:
        logits = output.full_tensor() if isinstance(output, DTensor) else output
        log_probs = torch.log_softmax(logits[mask].float(), dim=-1)
        picked = log_probs.gather(-1, targets[mask].unsqueeze(-1)).squeeze(-1).double()
    return torch.zeros(mask.shape[0], dtype=torch.float64, device=picked.device).index_add_(0, rows, picked)
