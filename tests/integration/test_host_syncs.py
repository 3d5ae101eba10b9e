"""The host-sync budget: the calls of one whole training step that would make the host wait for a GPU, counted
on CPU (tests/host_syncs.py) in the real Trainer on two gloo ranks, for dp2, tp2 (sequence and loss parallel:
DTensor), pp2 (1F1B) and MoE ep2, with the fused optimizer a CUDA job gets (`optimizer.implementation = "auto"`).

The step measured is a non-log step after the first (tests/count_host_syncs.py), and its syncs must be exactly
the budget below, by call site (file and function, not line). A new `.item()`, `.tolist()`, `bool(tensor)` or
nonzero-like op on the hot path fails here, with the stack of each call in the message. The budget:
- `StepVerdict.read`: 1 per step, every layout, and it must be the previous step's verdict, read from
  `StepGuard.settle_previous` after this step's forward and backward are queued. The update itself is applied
  conditionally on the device (the fused optimizer's skip flag), so the read never stands between a step and its
  update; on CUDA it waits for a pinned copy queued behind the previous step's all-reduce, never for the work
  queued after it, so the device does not run dry. (With an unfused optimizer the verdict is read in its own step,
  before the update: `test_an_unfused_optimizer_reads_the_verdict_in_its_own_step`.)
- MoE under expert parallelism, `_dispatch`: 1 per MoE layer per microbatch. A dropless all-to-all needs its split
  sizes on the host; one copy serves the dispatch and the experts.
"""

import json
from collections import Counter
from pathlib import Path

import pytest

from tests.launch import MOE_TINY, REPO, run_train

pytestmark = pytest.mark.slow

# Step 3 is measured: not the first, not a log step. Fused, as on CUDA.
STEPS = ["--training.steps", "4", "--metrics.log_freq", "100", "--optimizer.implementation", "fused"]
TINY = ["--model.flavor", "tiny", "--training.seq_len", "32", "--training.local_batch_size", "4", *STEPS]
MOE_LAYERS, MOE_MICROBATCHES = 2, 2  # the tiny MoE flavor's layers; global 8 = 2 microbatches x 2 x ep2 ranks
MOE = [*MOE_TINY, *STEPS]
VERDICT = "torchpre/health/verdict.py in read"
READ_LATE = "in settle_previous"
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
    """'torchpre/health/verdict.py in read' from '/.../torchpre/health/verdict.py:63 in read'."""
    location, _, function = sync["site"].partition(" in ")
    path = Path(location.rsplit(":", 1)[0])
    return f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path} in {function}"


def _count_syncs(args: list[str], folder: Path) -> list[list[dict]]:
    """Each rank's host syncs of the measured step."""
    result = run_train(args, 2, folder, script="tests/count_host_syncs.py")
    assert result.returncode == 0, f"training failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return [json.loads((folder / f"host_syncs_rank{rank}.json").read_text()) for rank in range(2)]


def _listing(syncs: list[dict]) -> str:
    return "\n".join(f"- {s['what']} from {s['site']}, stack:\n    " + "\n    ".join(s["stack"]) for s in syncs)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_host_syncs_of_a_step_are_the_budget(layout: str, tmp_path: Path):
    args, budget = LAYOUTS[layout]
    for rank, syncs in enumerate(_count_syncs(args, tmp_path)):
        found = Counter(_site(sync) for sync in syncs)
        listing = _listing(syncs)
        assert found == budget, f"rank {rank} of {layout}: host syncs {dict(found)}, budget {budget}:\n{listing}"
        (verdict,) = [sync for sync in syncs if _site(sync) == VERDICT]
        assert any(READ_LATE in frame for frame in verdict["stack"]), f"not the previous step's verdict:\n{listing}"


def test_an_unfused_optimizer_reads_the_verdict_in_its_own_step(tmp_path: Path):
    """Without a conditional update on the device, the verdict must be on the host before the update: one read in
    `train_step` itself."""
    for syncs in _count_syncs([*TINY, "--optimizer.implementation", "auto"], tmp_path):  # not fused on CPU
        (verdict,) = syncs
        assert _site(verdict) == VERDICT and not any(READ_LATE in frame for frame in verdict["stack"]), _listing(syncs)
