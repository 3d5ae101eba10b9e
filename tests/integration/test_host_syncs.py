"""The host-sync budget: the calls of one whole training step that would make the host wait for a GPU, counted
on CPU (tests/host_syncs.py) in the real Trainer on two gloo ranks, for dp2, tp2 (sequence and loss parallel:
DTensor), pp2 (1F1B) and MoE ep2.

The step measured is a non-log step after the first (tests/count_host_syncs.py), and its syncs must be exactly
the budget below, by call site (file and function, not line). A new `.item()`, `.tolist()`, `bool(tensor)` or
nonzero-like op on the hot path fails here, with the stack of each call in the message. The budget:
- `step_health`: 1 per step, every layout. The non-finite verdict (and the preemption flag riding with it) is
  read on the host before the update is applied: a non-finite step must never be applied. Deciding it on the
  device and applying the update conditionally would remove it (not done: it reaches into the optimizer step).
- MoE under expert parallelism, `_dispatch`: 1 per MoE layer per microbatch. A dropless all-to-all needs its split
  sizes on the host, and so does the experts' loop (no grouped-GEMM kernel); one copy serves both.
"""

import json
from collections import Counter
from pathlib import Path

import pytest

from tests.launch import MOE_TINY, REPO, run_train

pytestmark = pytest.mark.slow

STEPS = ["--training.steps", "4", "--metrics.log_freq", "100"]  # step 3 is measured: not the first, not a log step
TINY = ["--model.flavor", "tiny", "--training.seq_len", "32", "--training.local_batch_size", "4", *STEPS]
MOE_LAYERS, MOE_MICROBATCHES = 2, 2  # the tiny MoE flavor's layers; global 8 = 2 microbatches x 2 x ep2 ranks
MOE = [*MOE_TINY, *STEPS]
VERDICT = "torchpre/health.py in step_health"
DISPATCH = "torchpre/parallel/expert_parallel.py in _dispatch"

LAYOUTS = {
    "dp2": (TINY, {VERDICT: 1}),
    "tp2-sp-loss-parallel": (
        [*TINY, "--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_sequence_parallel",
         "--parallelism.enable_loss_parallel"],
        {VERDICT: 1},
    ),
    "pp2-1F1B": (
        [*TINY, "--training.global_batch_size", "8", "--parallelism.pipeline_parallel_degree", "2",
         "--parallelism.pipeline_parallel_schedule", "1F1B"],
        {VERDICT: 1},
    ),
    "moe-ep2": (
        [*MOE, "--parallelism.expert_parallel_degree", "2"],
        {VERDICT: 1, DISPATCH: MOE_LAYERS * MOE_MICROBATCHES},
    ),
}


def _site(sync: dict) -> str:
    """'torchpre/health.py in step_health' from '/.../torchpre/health.py:62 in step_health'."""
    location, _, function = sync["site"].partition(" in ")
    path = Path(location.rsplit(":", 1)[0])
    return f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path} in {function}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_host_syncs_of_a_step_are_the_budget(layout: str, tmp_path: Path):
    args, budget = LAYOUTS[layout]
    result = run_train(args, 2, tmp_path, script="tests/count_host_syncs.py")
    assert result.returncode == 0, f"training failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    for rank in range(2):
        syncs = json.loads((tmp_path / f"host_syncs_rank{rank}.json").read_text())
        found = Counter(_site(sync) for sync in syncs)
        listing = "\n".join(f"- {s['what']} from {s['site']}, stack:\n    " + "\n    ".join(s["stack"]) for s in syncs)
        assert found == budget, f"rank {rank} of {layout}: host syncs {dict(found)}, budget {budget}:\n{listing}"
