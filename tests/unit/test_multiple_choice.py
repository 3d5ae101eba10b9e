"""Multiple-choice scoring: lm-evaluation-harness's acc and acc_norm, its tokenization of a (context, continuation)
pair, the task file's errors, which name the file and line, and lm-evaluation-harness's window on a long context,
on a tiny model (the scores against transformers under dp2 and pp2 are in tests/integration/test_hf_export_eval.py)."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from scripts import tiny_tokenizer
from torchpre.data.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer
from torchpre.errors import ConfigError, TorchpreError
from torchpre.evaluation.multiple_choice import (
    MultipleChoiceEvaluator,
    Question,
    Row,
    Task,
    _continuation_log_likelihoods,
    accuracies,
    encode_pair,
    read_task,
    read_tasks,
)
from torchpre.models.llama3.args import LLAMA3_FLAVORS
from torchpre.models.llama3.model import Transformer
from torchpre.parallel import ParallelPlan, parallelize

TOKENIZER = load_tokenizer(DEFAULT_TOKENIZER_PATH)


def test_acc_takes_the_highest_log_likelihood_and_acc_norm_divides_by_characters():
    """Question 1: the long answer has the lower sum (-6 < -4) but the higher per-character score (-6/12 > -4/2);
    "é" counts as one character, as Python's len (lm-evaluation-harness's) counts it. Question 2: a tie goes to
    the first choice, as numpy's argmax."""
    questions = [Question("q", ["no", "oui, très bi"], 1), Question("q", ["a", "b"], 0)]
    assert len(questions[0].choices[1]) == 12 and len(questions[0].choices[1].encode()) == 13
    assert accuracies(questions, [-4.0, -6.0, -1.0, -1.0]) == {"acc": 0.5, "acc_norm": 1.0}


def test_a_pair_is_tokenized_as_lm_evaluation_harness_does():
    """BOS + context, then the tokens of the whole text after the context's; a trailing space of the context moves
    to the continuation, so it is scored with the choice as it would be read."""
    context, continuation = encode_pair(TOKENIZER, "The capital of France is", " Paris")
    assert context[0] == TOKENIZER.bos_id
    assert TOKENIZER.decode(context[1:]) == "The capital of France is"
    assert TOKENIZER.decode(continuation) == " Paris"
    assert encode_pair(TOKENIZER, "The capital of France is ", "Paris") == (context, continuation)


@pytest.mark.parametrize("kind", ["byte_level", "byte_fallback"])
def test_a_pair_of_a_hugging_face_tokenizer_is_transformers_ids_split_as_lm_evaluation_harness_splits(tmp_path, kind):
    """lm-evaluation-harness on transformers' tokenizer with add_bos_token: the context's ids are
    `tokenizer(context)`'s (BOS where the family adds one, Mistral's; none for Qwen's), the continuation's those of
    the whole text after them. An empty context gets its prefix token, EOS."""
    transformers = pytest.importorskip("transformers")
    folder = tiny_tokenizer.write(kind, tmp_path / kind)
    reference, ours = transformers.AutoTokenizer.from_pretrained(folder), load_tokenizer(folder)
    for context, choice in [("The capital of France is", " Paris"), ("Déjà vu:", " 日本語"), ("x", "\n\ty")]:
        expected = reference(context)["input_ids"]
        whole = reference(context + choice)["input_ids"]
        assert encode_pair(ours, context, choice) == (expected, whole[len(expected) :])
    assert encode_pair(ours, "", "Paris")[0] == [ours.eos_id if ours.bos_id is None else ours.bos_id]


def test_a_long_row_keeps_its_last_tokens(tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"context": " ".join(["word"] * 40), "choices": ["yes", "no"], "answer": 0}) + "\n")
    task = read_task(str(path), TOKENIZER, max_length=16)
    assert [len(row.tokens) for row in task.rows] == [17, 17]
    assert TOKENIZER.decode(task.rows[0].tokens[-task.rows[0].continuation_length :]) == " yes"


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "not valid JSON"),
        ('{"choices": ["a", "b"], "answer": 0}', "'context' is missing"),
        ('{"context": "c", "choices": ["a"], "answer": 0}', "at least two non-empty strings"),
        ('{"context": "c", "choices": ["a", "b"], "answer": 2}', "'answer' = 2 is not an index into its 2 choices"),
        ('{"context": "c", "choices": ["a", "b"], "answer": "a"}', "'answer' is \"a\", not an integer"),
    ],
)
def test_a_malformed_line_is_named_by_file_and_line(tmp_path, line, message):
    """Named `file:3:` for a record of the wrong form, `file (line 3)` for a line that is no JSON (json_input's)."""
    path = tmp_path / "task.jsonl"
    path.write_text('{"context": "c", "choices": ["a", "b"], "answer": 1}\n\n' + line + "\n")
    with pytest.raises(TorchpreError, match="eval.tasks: " + re.escape(str(path)) + r"(:3:| \(line 3\)) ") as error:
        read_task(str(path), TOKENIZER, max_length=32)
    assert message in str(error.value)
    assert not isinstance(error.value, ConfigError)  # the file is at fault, not eval.tasks


def test_a_choice_longer_than_the_sequence_is_named_by_file_and_line(tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text('\n{"context": "c", "choices": ["a", "' + "word " * 40 + '"], "answer": 0}\n')
    message = f"eval.tasks: {path}:2: the choice .* tokens, more than the 16 the model reads of a row .eval.max_length"
    with pytest.raises(ConfigError, match=message):
        read_task(str(path), TOKENIZER, max_length=16)


def test_two_tasks_of_one_name_are_refused(tmp_path):
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "arc.jsonl").write_text('{"context": "c", "choices": ["a", "b"], "answer": 1}\n')
    with pytest.raises(ConfigError, match="two files are named 'arc.jsonl'"):
        read_tasks([str(tmp_path / "a" / "arc.jsonl"), str(tmp_path / "b" / "arc.jsonl")], TOKENIZER, 32)


def _evaluator(rows: list[Row], seq_len: int, tp: int) -> MultipleChoiceEvaluator:
    task = Task("t", Path("t.jsonl"), [], rows)
    return MultipleChoiceEvaluator(
        task, freq=1, model=None, device=torch.device("cpu"), local_batch_size=3, max_length=seq_len, tp=tp,
        data_rank=(0, 1), groups=[], forward_kwargs=lambda inputs: {}, pad_id=0, samples_folder=None,
    )  # fmt: skip


@pytest.mark.parametrize("longest, seq_len, tp, length", [(10, 256, 1, 64), (70, 256, 1, 128), (70, 256, 3, 192),
                                                          (200, 256, 1, 256), (10, 32, 1, 32)])  # fmt: skip
def test_a_batch_is_padded_to_its_longest_row_rounded_up_within_the_sequence_length(longest, seq_len, tp, length):
    """Rows of `longest` + 1 tokens and 4 (the last 2 the choice's): a batch of the two and one padding row."""
    rows = [Row(list(range(1, longest + 2)), 3), Row([5, 6, 7, 8], 2)]
    inputs, targets, mask = _evaluator(rows, seq_len, tp)._batch([0, 1])
    assert inputs.shape == targets.shape == mask.shape == (3, length)
    assert inputs[0, :longest].tolist() == list(range(1, longest + 1))
    assert targets[0, :longest].tolist() == list(range(2, longest + 2))
    assert mask[0].nonzero().flatten().tolist() == [longest - 3, longest - 2, longest - 1]
    assert mask[1].nonzero().flatten().tolist() == [1, 2] and not mask[2].any()
    assert inputs[1, :3].tolist() == [5, 6, 7] and targets[1, :3].tolist() == [6, 7, 8]


def test_a_rows_log_likelihood_sums_its_choices_targets_only():
    """Against a plain loop over positions: only the masked targets count, each row on its own."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 8, 11, generator=generator)
    targets = torch.randint(0, 11, (3, 8), generator=generator)
    mask = torch.zeros(3, 8, dtype=torch.bool)
    mask[0, 5:7], mask[1, 2:3] = True, True
    log_probs = torch.log_softmax(logits.double(), -1)
    expected = [
        sum(log_probs[row, pos, targets[row, pos]].item() for pos in range(8) if mask[row, pos]) for row in range(3)
    ]
    # fp32 log-softmax against fp64: ~1e-7 apart
    assert _continuation_log_likelihoods(logits, targets, mask).tolist() == pytest.approx(expected, abs=1e-6)


def lm_eval_log_likelihood(model: torch.nn.Module, context_enc: list[int], continuation_enc: list[int],
                           max_length: int) -> float:
    """lm-evaluation-harness's `HFLM._loglikelihood_tokens` for one request, as written there (v0.4): the input is
    `(context_enc + continuation_enc)[-(max_length + 1):][:-1]`, and the continuation's log-probabilities are read
    at `logits[inplen - contlen : inplen]`."""
    inp = torch.tensor((context_enc + continuation_enc)[-(max_length + 1) :][:-1])
    (inplen,) = inp.shape
    contlen = len(continuation_enc)
    with torch.no_grad():
        logits = torch.log_softmax(model(inp.unsqueeze(0))[0].double(), dim=-1)
    logits = logits[inplen - contlen : inplen]
    return logits.gather(-1, torch.tensor(continuation_enc).unsqueeze(-1)).sum().item()


def test_the_window_of_a_long_context_is_lm_evaluation_harness_s_max_length(mesh, tmp_path):
    """A context of about 150 tokens scored with eval.max_length 48 and 96 (each shorter than the row): the evaluator's
    log-likelihoods equal lm-evaluation-harness's definition on the same model within 1e-5 (measured: at most
    1.4e-6; the evaluator runs a padded batch of rows, the reference one row at a time). The two windows give
    log-likelihoods 1.6e-2 to 6e-2 apart, so a window off by its definition cannot pass."""
    context = " ".join(f"item {i} is {'odd' if i % 2 else 'even'}," for i in range(30)) + " and item 30 is"
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"context": context, "choices": ["even", "odd", "neither of them"], "answer": 0}))
    args = dataclasses.replace(LLAMA3_FLAVORS["tiny"], vocab_size=TOKENIZER.vocab_size, max_seq_len=256)
    with torch.device("meta"):
        model = Transformer(args)
    parallel = parallelize(model, mesh, ParallelPlan(), device=torch.device("cpu"),
                           init_weights=lambda m: m.init_weights(0))
    with torch.no_grad():  # sharper than at initialisation, so that the tokens a window drops matter
        for param in parallel.parts[0].parameters():
            param.mul_(2)
    scores = {}
    for max_length in (48, 96):
        task = read_task(str(path), TOKENIZER, max_length=max_length)
        evaluator = MultipleChoiceEvaluator(
            task, freq=1, model=parallel, device=torch.device("cpu"), local_batch_size=2, max_length=max_length, tp=1,
            data_rank=(0, 1), groups=[], forward_kwargs=lambda inputs: {}, pad_id=TOKENIZER.eos_id, samples_folder=None,
        )  # fmt: skip
        scores[max_length] = evaluator.log_likelihoods()
        expected = []
        for choice in task.questions[0].choices:
            context_enc, continuation_enc = encode_pair(TOKENIZER, context, " " + choice)
            assert len(context_enc) + len(continuation_enc) > 150  # longer than either window
            expected.append(lm_eval_log_likelihood(parallel.parts[0].eval(), context_enc, continuation_enc, max_length))
        assert scores[max_length] == pytest.approx(expected, abs=1e-5, rel=0)
    assert min(abs(a - b) for a, b in zip(scores[48], scores[96])) > 1e-2
