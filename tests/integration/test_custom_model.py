"""A model torchpre has never seen, defined only in the tests, trained through the public API under every layout.

`GPT2` (tests/gpt2_model.py) is a GPT-2-style decoder (LayerNorm, learned position embeddings, GELU MLP,
biases, tied embeddings). Run as a script, this file registers it as `model.name = "gpt2-test"` and runs
torchpre.train's main (or torchpre.generate's), exactly as a user's own launcher would.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor.parallel import ColwiseParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.gpt2_model import GPT2, SPEC, TP_PLAN, GPT2Args  # noqa: E402
from tests.launch import REPO, run_train, train_and_read_metrics  # noqa: E402
from torchpre.errors import ConfigError  # noqa: E402
from torchpre.models.registry import register_model  # noqa: E402
from torchpre.parallel import ParallelPlan, parallelize  # noqa: E402

THIS_FILE = Path(__file__).relative_to(REPO)

ARGS = [
    "--model.name", "gpt2-test",
    "--model.flavor", "tiny",
    "--training.seq_len", "32",
    "--training.local_batch_size", "4",
    "--training.global_batch_size", "8",
    "--training.steps", "8",
    "--lr_scheduler.warmup_steps", "2",
    "--optimizer.lr", "3e-3",
    "--metrics.log_freq", "1",
]
# fp32 on CPU; layouts differ only in reduction order (see test_train.py for the argument).
LOSS_TOLERANCE = 1e-4

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    folder = tmp_path_factory.mktemp("gpt2-reference")
    records = train_and_read_metrics(ARGS, 1, folder, script=str(THIS_FILE))
    return [r["loss"] for r in records]


def test_the_model_learns(reference):
    assert reference[0] == pytest.approx(math.log(2048), abs=0.05)
    assert reference[-1] < reference[0] - 0.1


@pytest.mark.parametrize(
    "layout, nproc",
    [
        (["--parallelism.tensor_parallel_degree", "2"], 2),
        (["--parallelism.pipeline_parallel_degree", "2"], 2),
        (["--parallelism.tensor_parallel_degree", "2", "--optimizer.zero_stage", "1"], 4),
    ],
    ids=["tp2", "pp2", "dp2xtp2-zero1"],
)
def test_layout_matches_one_process(reference, layout, nproc, tmp_path):
    records = train_and_read_metrics([*ARGS, *layout], nproc, tmp_path, script=str(THIS_FILE))
    assert [r["loss"] for r in records] == pytest.approx(reference, abs=LOSS_TOLERANCE)


def test_checkpoint_resumes_and_generates_under_another_layout(reference, tmp_path):
    """Saved under pp2 at step 4, resumed single-process to step 8: the losses continue the reference; then
    the checkpoint generates text (no KV cache: the model recomputes the sequence) under tp2 and converts to a
    Hugging Face GPT-2 that transformers runs to the same logits."""
    checkpoint = ["--checkpoint.enable", "--checkpoint.interval", "4"]
    first = [*ARGS, *checkpoint, "--training.steps", "8", "--parallelism.pipeline_parallel_degree", "2"]
    result = run_train([*first, "--checkpoint.keep_latest_k", "0"], 2, tmp_path, script=str(THIS_FILE))
    assert result.returncode == 0, result.stderr[-3000:]
    (tmp_path / "checkpoint" / "step-8").rename(tmp_path / "step-8-done")
    (tmp_path / "metrics.jsonl").unlink()
    records = train_and_read_metrics([*ARGS, *checkpoint], 1, tmp_path, script=str(THIS_FILE))
    assert [r["step"] for r in records] == [5, 6, 7, 8]
    assert [r["loss"] for r in records] == pytest.approx(reference[4:], abs=LOSS_TOLERANCE)

    generate = ["generate", *ARGS, "--parallelism.tensor_parallel_degree", "2", "--prompt", "Once upon a time",
                "--max_new_tokens", "5", "--temperature", "0", "--json"]
    result = run_train(generate, 2, tmp_path, script=str(THIS_FILE))
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(json.loads(result.stdout.strip().splitlines()[-1])["token_ids"]) == 5

    # Converted to a Hugging Face GPT-2 folder, the weights give transformers the logits they give torchpre.
    hf_dir = tmp_path / "hf"
    command = [sys.executable, str(THIS_FILE), "convert", "dcp-to-hf", str(tmp_path / "checkpoint" / "step-8"),
               str(hf_dir), *ARGS]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    transformers = pytest.importorskip("transformers")
    theirs = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    ours = GPT2(GPT2Args(vocab_size=theirs.config.vocab_size))
    weights = {name: torch.empty_like(tensor) for name, tensor in ours.state_dict().items()}
    dcp.load({"model": weights}, checkpoint_id=tmp_path / "checkpoint" / "step-8", no_dist=True)
    ours.load_state_dict(weights)
    tokens = torch.randint(0, theirs.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # fp32, the same operations in another order: 1e-5 is rounding
        torch.testing.assert_close(theirs(tokens).logits, ours(tokens), rtol=1e-5, atol=1e-5)


def test_a_plan_naming_a_missing_module_is_a_clear_error():
    with torch.device("meta"):
        model = GPT2(GPT2Args())
    plan = ParallelPlan(tensor_parallel={**TP_PLAN, "h.*.mlp.c_fc": ColwiseParallel()}, blocks="h")
    message = r"plan key 'h\.\*\.mlp\.c_fc'.*'h\.0\.mlp\.c_fc' is not a submodule.*mlp\.fc"
    with pytest.raises(ConfigError, match=message):
        parallelize(model, None, plan, device=torch.device("cpu"), init_weights=lambda m: None)


if __name__ == "__main__":
    from torchpre.runtime.cli import run_entry_point

    register_model("gpt2-test", SPEC)
    argv = sys.argv[1:]
    if argv[:1] == ["convert"]:  # `... test_custom_model.py convert dcp-to-hf SRC DST [options]`
        from torchpre.convert import main as entry_point

        argv = argv[1:]
    elif "generate" in argv:  # `... test_custom_model.py [options] generate [options]` runs torchpre.generate
        from torchpre.generate import main as entry_point

        argv.remove("generate")
    else:
        from torchpre.train import main as entry_point
    run_entry_point(entry_point, argv, prog=str(THIS_FILE))
