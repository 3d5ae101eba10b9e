"""Multiple-choice scoring without a model: lm-evaluation-harness's acc and acc_norm, its tokenization of a
(context, continuation) pair, and the task file's errors, which name the file and line (the scores against
transformers under dp2 and pp2 are in tests/integration/test_hf_export_eval.py)."""

import json

import pytest

from torchpre.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer
from torchpre.errors import ConfigError
from torchpre.training.multiple_choice import Question, accuracies, encode_pair, read_task, read_tasks

TOKENIZER = Tokenizer(DEFAULT_TOKENIZER_PATH)


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


def test_a_long_row_keeps_its_last_tokens(tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"context": " ".join(["word"] * 40), "choices": ["yes", "no"], "answer": 0}) + "\n")
    task = read_task(str(path), TOKENIZER, seq_len=16)
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
    path = tmp_path / "task.jsonl"
    path.write_text('{"context": "c", "choices": ["a", "b"], "answer": 1}\n\n' + line + "\n")
    with pytest.raises(ConfigError, match="eval.tasks: " + str(path) + ":3: ") as error:
        read_task(str(path), TOKENIZER, seq_len=32)
    assert message in str(error.value)


def test_a_choice_longer_than_the_sequence_is_named_by_file_and_line(tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text('\n{"context": "c", "choices": ["a", "' + "word " * 40 + '"], "answer": 0}\n')
    message = f"eval.tasks: {path}:2: the choice .* tokens, more than training.seq_len = 16"
    with pytest.raises(ConfigError, match=message):
        read_task(str(path), TOKENIZER, seq_len=16)


def test_two_tasks_of_one_name_are_refused(tmp_path):
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "arc.jsonl").write_text('{"context": "c", "choices": ["a", "b"], "answer": 1}\n')
    with pytest.raises(ConfigError, match="two files are named 'arc.jsonl'"):
        read_tasks([str(tmp_path / "a" / "arc.jsonl"), str(tmp_path / "b" / "arc.jsonl")], TOKENIZER, 32)
