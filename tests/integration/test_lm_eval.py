"""lm-evaluation-harness itself against torchpre's multiple-choice evaluator (`-m lm_eval`, the `lm-eval` extra).

The tiny model trains 20 steps with the shipped task (examples/eval/tiny_choices.jsonl) evaluated and exported at
steps 10 and 20. lm-evaluation-harness 0.4.13's own Hugging Face model class (`HFLM`, `--model hf`) then scores the
same task, written as an lm-evaluation-harness `multiple_choice` task over the same JSONL file, on each export: its
`acc` and `acc_norm` must equal those torchpre logged for that step, and each choice's log-likelihood (its
`--log_samples` record) must equal the one torchpre wrote to eval/<task>/step-N.jsonl within LL_ATOL.

HFLM is told the two things torchpre's evaluator does differently from its defaults: a BOS token before each row
(`add_bos_token=True`: torchpre scores as documents are trained, after BOS; HFLM adds none by default) and the
window (`max_length` = eval.max_length, as docs/evaluation.md says to).

    pip install -e ".[lm-eval]" && python -m pytest -q -m lm_eval tests/integration/test_lm_eval.py

Tolerance (fp32 on CPU): the two sum the same log-probabilities from the same weights, torchpre on its own model and
lm-evaluation-harness on transformers' Llama, so they differ by reduction order only: measured at most 3.8e-6 (step
10) and 1.6e-5 (step 20) on log-likelihoods of 7.3 to 134 in size (1.2e-7 relative); LL_ATOL = 1e-4.
"""

import json
import os
from pathlib import Path

import pytest

from tests.launch import REPO, TINY, train_and_read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.lm_eval]

TASK_FILE = REPO / "examples" / "eval" / "tiny_choices.jsonl"
TASK = TASK_FILE.stem
STEPS = (10, 20)
MAX_LENGTH = 32
LL_ATOL = 1e-4


def lm_eval_task(folder: Path, name: str, data: Path) -> Path:
    """An lm-evaluation-harness task over torchpre's task file: each line's context, choices and answer index,
    scored as `multiple_choice` with its default target delimiter " " and metrics acc and acc_norm."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "context",
        "doc_to_choice": "choices",
        "doc_to_target": "answer",
        "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}],
    }
    path = folder / f"{name}.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return folder


def lm_eval_scores(export: Path, tasks: Path) -> tuple[dict[str, float], list[list[float]]]:
    """lm-evaluation-harness's acc and acc_norm on one export, and each question's log-likelihoods in file order."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={export},dtype=float32,add_bos_token=True,max_length={MAX_LENGTH}",
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(tasks)),
        batch_size=4,
        device="cpu",
        log_samples=True,
    )
    metrics = results["results"][TASK]
    samples = sorted(results["samples"][TASK], key=lambda sample: sample["doc_id"])
    log_likelihoods = [[float(response[0]) for response in sample["filtered_resps"]] for sample in samples]
    return {"acc": metrics["acc,none"], "acc_norm": metrics["acc_norm,none"]}, log_likelihoods


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, list[dict]]:
    folder = tmp_path_factory.mktemp("lm_eval")
    args = [
        "--job.config_file", "train_configs/debug_model.toml", *TINY, "--training.steps", str(STEPS[-1]),
        "--eval.tasks", str(TASK_FILE), "--eval.freq", str(STEPS[0]), "--eval.max_length", str(MAX_LENGTH),
        "--hf_export.enable", "--hf_export.interval", str(STEPS[0]),
    ]  # fmt: skip
    return folder, train_and_read_metrics(args, 1, folder)


@pytest.mark.parametrize("step", STEPS)
def test_lm_evaluation_harness_scores_the_export_as_torchpre_scored_the_step(run, step, tmp_path):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    folder, records = run
    record = next(r for r in records if r["step"] == step)
    theirs, their_lls = lm_eval_scores(folder / "hf" / f"step-{step}", lm_eval_task(tmp_path, TASK, TASK_FILE))
    ours = {metric: record[f"eval/{TASK}/{metric}"] for metric in ("acc", "acc_norm")}
    our_lls = [json.loads(line)["log_likelihoods"] for line in
               (folder / "eval" / TASK / f"step-{step}.jsonl").read_text().splitlines()]  # fmt: skip
    assert len(their_lls) == len(our_lls) == 6
    for mine, other in zip(our_lls, their_lls):
        assert mine == pytest.approx(other, abs=LL_ATOL)
    assert ours == theirs
