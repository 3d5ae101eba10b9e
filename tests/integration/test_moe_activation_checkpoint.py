"""Per-op selective activation checkpointing keeps the all-to-all of expert parallelism (its output replaces a
recomputed collective in backward): ep2 training with it gives the losses and gradient norms of ep2 without
checkpointing, bit for bit (recompute reruns the same fp32 ops on the same CPU, and a kept output is the value
itself)."""

import pytest

from tests.integration.test_moe import MOE
from tests.launch import train_and_read_metrics

pytestmark = pytest.mark.slow

EP2 = ["--parallelism.expert_parallel_degree", "2"]
OP_AC = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]


def test_ep2_with_per_op_checkpointing_trains_exactly_as_without(tmp_path):
    plain = train_and_read_metrics([*MOE, *EP2], 2, tmp_path / "plain")
    checkpointed = train_and_read_metrics([*MOE, *EP2, *OP_AC], 2, tmp_path / "op-ac")
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in checkpointed] == [r[key] for r in plain], key
