"""Hugging Face exports and multiple-choice evaluation during training, end to end through train.py.

Four runs of the tiny model, 4 steps each, exporting and evaluating at steps 2 and 4 and checkpointing step 4: one
process (exports kept: the newest only), dp2 ZeRO-3 (synchronous export), pp2 1F1B and tp2 with loss parallel (the
evaluator gathers vocab-sharded logits; asynchronous exports, the default).
Each export at step 4 loads in transformers and gives the logits of torchpre's model loaded from the same run's
checkpoint of step 4; its tensors are the family's mapping of that checkpoint bitwise, written by both ranks
without either writing the whole model. The evaluator's per-choice log-likelihoods equal transformers' on the
exported model with its exported tokenizer, so do its acc and acc_norm, and the three layouts agree.

Tolerances (fp32 on CPU, measured on this machine at 2ab4895, all four layouts):
- logits, torchpre vs transformers on the same weights: reduction-order noise only (see test_hf_convert.py),
  measured at most 9.5e-7 on logits up to 4.8; LOGITS_ATOL = 1e-5 as there.
- a choice's log-likelihood (a sum of up to ~20 token log-probabilities; up to 109 in size), torchpre's evaluator
  vs transformers: measured at most 1.8e-6; across layouts at most 1.9e-6 (their weights after 4 steps differ by
  reduction order, ~2e-7). LL_ATOL = 1e-4: scoring the context's tokens too moves them by tens.
"""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open

from tests.launch import TINY, train_and_read_metrics
from torchpre.data.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer
from torchpre.models.llama3.args import LLAMA3_FLAVORS
from torchpre.models.llama3.hf import to_hf_state_dict
from torchpre.models.llama3.model import Transformer

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

LOGITS_ATOL = 1e-5
LL_ATOL = 1e-4
TASK = "choices"
QUESTIONS = [
    ("The capital of France is", ["a large sandwich", "Paris", "blue"], 1),
    ("def add(a, b):\n    return", ["a + b", "elephant", "the moon"], 0),
    ("Water freezes at zero degrees ", ["sandwiches.", "in a sentence that goes on without end.", "Celsius."], 2),
    ("To open a file in Python, call", ["the fire brigade", "open()", "print"], 1),
    ("import os\nimport", ["banana split", "the", "sys"], 2),
    ("Un café, s'il vous", ["plaît", "seven hundred", "purple"], 0),
    ("One, two, three,", ["four", "five", "six", "seven"], 0),
    # Longer than eval.max_length: the model reads the last MAX_LENGTH tokens, lm-evaluation-harness's window.
    ("Count with me: " + ", ".join(str(i) for i in range(1, 12)) + ",", ["twelve", "12", "a dozen eggs"], 1),
]
MAX_LENGTH = 24
COMMON = [
    *TINY, "--training.steps", "4",
    "--eval.freq", "2", "--eval.local_batch_size", "4", "--eval.max_length", str(MAX_LENGTH),
    "--hf_export.enable", "--hf_export.interval", "2",
    "--checkpoint.enable", "--checkpoint.interval", "4",
]  # fmt: skip
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B"]
LAYOUTS = {
    "one": (1, ["--hf_export.keep_latest_k", "1", "--metrics.enable_tensorboard"]),
    "zero3": (2, [
        "--training.local_batch_size", "2", "--optimizer.zero_stage", "3", "--hf_export.async_mode", "disabled",
    ]),  # fmt: skip
    "pp2": (2, PP2),
    "tp2": (2, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_loss_parallel"]),
}


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("task") / f"{TASK}.jsonl"
    lines = [json.dumps({"context": c, "choices": choices, "answer": a}) for c, choices, a in QUESTIONS]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory, task):
    """Each layout's (dump folder, metrics records), trained once per module."""
    cache: dict[str, tuple[Path, list[dict]]] = {}

    def run(name: str) -> tuple[Path, list[dict]]:
        if name not in cache:
            nproc, args = LAYOUTS[name]
            folder = tmp_path_factory.mktemp(name)
            cache[name] = folder, train_and_read_metrics([*COMMON, "--eval.tasks", str(task), *args], nproc, folder)
        return cache[name]

    return run


def hf_tensors(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Each safetensors file's tensors, by file."""
    return {
        path.name: {name: file.get_tensor(name) for name in file.keys()}
        for path in sorted(folder.glob("*.safetensors"))
        for file in [safe_open(path, "pt")]
    }


def checkpoint_model(step_dir: Path) -> Transformer:
    """torchpre's model of the tiny flavor with a checkpoint's weights."""
    vocab_size = load_tokenizer(DEFAULT_TOKENIZER_PATH).vocab_size
    args = dataclasses.replace(LLAMA3_FLAVORS["tiny"], vocab_size=vocab_size, max_seq_len=32)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(0)  # the RoPE buffers; the weights come from the checkpoint
    state_dict = model.state_dict()
    dcp.load({"model": state_dict}, checkpoint_id=step_dir, no_dist=True)
    model.load_state_dict(state_dict)
    return model.eval()


def transformers_log_likelihoods(folder: Path) -> list[list[float]]:
    """Per question, each choice's summed log-probability after the context, by transformers alone: the exported
    model and tokenizer, the continuation " " + choice as lm-evaluation-harness appends it, the model reading
    lm-evaluation-harness's window of max_length = MAX_LENGTH tokens."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    scores = []
    for context, choices, _ in QUESTIONS:
        # lm-evaluation-harness scores the tokens of context + continuation after those of the context, a trailing
        # space of the context moved to the continuation
        prefix = tokenizer(context.rstrip())["input_ids"]
        row = []
        for choice in choices:
            ids = tokenizer(f"{context} {choice}")["input_ids"]
            continuation = ids[len(prefix) :]
            window = ids[-(MAX_LENGTH + 1) :][:-1]  # HFLM._loglikelihood_tokens' input
            with torch.no_grad():
                log_probs = torch.log_softmax(model(torch.tensor([window])).logits[0].double(), dim=-1)
            start = len(window) - len(continuation)
            row.append(sum(log_probs[start + i, token].item() for i, token in enumerate(continuation)))
        scores.append(row)
    assert max(len(tokenizer(f"{c} {choice}")["input_ids"]) for c, choices, _ in QUESTIONS for choice in choices) > (
        MAX_LENGTH + 1
    )  # one question is cut by the window
    return scores


def evaluator_log_likelihoods(folder: Path, step: int) -> list[list[float]]:
    lines = (folder / "eval" / TASK / f"step-{step}.jsonl").read_text().splitlines()
    return [json.loads(line)["log_likelihoods"] for line in lines]


def expected_accuracies(scores: list[list[float]]) -> dict[str, float]:
    """lm-evaluation-harness's acc and acc_norm (log-likelihood over the choice's length in characters)."""
    def argmax(values: list[float]) -> int:
        return max(range(len(values)), key=lambda i: (values[i], -i))

    acc = [argmax(row) == answer for row, (_, _, answer) in zip(scores, QUESTIONS)]
    norm = [
        argmax([score / len(choice) for score, choice in zip(row, choices)]) == answer
        for row, (_, choices, answer) in zip(scores, QUESTIONS)
    ]
    return {f"eval/{TASK}/acc": sum(acc) / len(acc), f"eval/{TASK}/acc_norm": sum(norm) / len(norm)}


def at_step(records: list[dict], step: int) -> dict:
    return next(record for record in records if record["step"] == step)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_export_at_step_n_loads_in_transformers_with_torchpre_logits(runs, layout):
    folder, _ = runs(layout)
    export = folder / "hf" / "step-4"
    torchpre_model = checkpoint_model(folder / "checkpoint" / "step-4")
    mapped = to_hf_state_dict(torchpre_model.state_dict(), torchpre_model.args)
    written = {name: tensor for tensors in hf_tensors(export).values() for name, tensor in tensors.items()}
    assert written.keys() == mapped.keys()
    for name, tensor in mapped.items():  # what dcp-to-hf makes of the same step's checkpoint
        assert torch.equal(written[name], tensor), name
    model = transformers.AutoModelForCausalLM.from_pretrained(export, torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, torchpre_model.args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs, ours = model(tokens).logits, torchpre_model(tokens)
    assert (theirs - ours).abs().max().item() < LOGITS_ATOL


@pytest.mark.parametrize("layout", ["zero3", "pp2", "tp2"])
def test_both_ranks_write_a_part_and_neither_the_whole_model(runs, layout):
    folder, _ = runs(layout)
    export = folder / "hf" / "step-4"
    files = hf_tensors(export)
    index = json.loads((export / "model.safetensors.index.json").read_text())
    sizes = {file: sum(t.numel() * t.element_size() for t in tensors.values()) for file, tensors in files.items()}
    assert sorted(files) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert index["weight_map"] == {name: file for file, tensors in files.items() for name in tensors}
    assert index["metadata"]["total_size"] == sum(sizes.values())
    names = [name for tensors in files.values() for name in tensors]
    assert len(names) == len(set(names))  # each tensor written once
    assert max(sizes.values()) < 0.75 * sum(sizes.values()), sizes


def test_only_the_newest_exports_are_kept_and_none_is_left_unfinished(runs):
    kept_one, _ = runs("one")
    kept_all, _ = runs("zero3")
    assert sorted(path.name for path in (kept_one / "hf").iterdir()) == ["step-4"]
    assert sorted(path.name for path in (kept_all / "hf").iterdir()) == ["step-2", "step-4"]


@pytest.mark.parametrize("layout, step", [("one", 4), ("zero3", 2), ("pp2", 4)])
def test_multiple_choice_scores_equal_transformers_on_the_export(runs, layout, step):
    folder, records = runs(layout)
    expected = transformers_log_likelihoods(folder / "hf" / f"step-{step}")
    scores = evaluator_log_likelihoods(folder, step)
    assert [len(row) for row in scores] == [len(row) for row in expected]
    for ours, theirs in zip(scores, expected):
        assert ours == pytest.approx(theirs, abs=LL_ATOL)
    accuracies = expected_accuracies(expected)
    assert {key: at_step(records, step)[key] for key in accuracies} == accuracies


def test_every_layout_gives_the_same_scores_logged_at_the_eval_steps(runs):
    reference_folder, reference = runs("one")
    assert [r["step"] for r in reference if f"eval/{TASK}/acc" in r] == [2, 4]
    keys = (f"eval/{TASK}/acc", f"eval/{TASK}/acc_norm")
    for layout in ("zero3", "pp2", "tp2"):
        folder, records = runs(layout)
        for step in (2, 4):
            assert [at_step(records, step)[key] for key in keys] == [at_step(reference, step)[key] for key in keys]
            expected = evaluator_log_likelihoods(reference_folder, step)
            for ours, theirs in zip(evaluator_log_likelihoods(folder, step), expected):
                assert ours == pytest.approx(theirs, abs=LL_ATOL), (layout, step)


def test_the_scores_reach_tensorboard(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder, records = runs("one")
    events = EventAccumulator(str(folder / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    for metric in ("acc", "acc_norm"):
        name = f"eval/{TASK}/{metric}"
        logged = [(event.step, event.value) for event in events.Scalars(name)]
        assert logged == [(r["step"], pytest.approx(r[name])) for r in records if name in r]


def test_evaluation_and_export_leave_pipeline_training_unchanged(runs, tmp_path):
    _, with_both = runs("pp2")
    without = train_and_read_metrics([*TINY, "--training.steps", "4", *PP2], 2, tmp_path)
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in with_both] == [r[key] for r in without], key
