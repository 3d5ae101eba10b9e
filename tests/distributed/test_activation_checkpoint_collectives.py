"""Per-op selective activation checkpointing keeps the tensor-parallel collectives it lists: under tp2 (gloo) the
reduce-scatter of sequence parallelism and the all-reduce of plain tensor parallelism run in backward exactly as
often as without checkpointing (for the backward of their inverse collectives only), while full checkpointing runs
them again in recompute.
The all-gather of sequence parallelism is recomputed on purpose (see `_saved_ops`)."""

import dataclasses
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import TorchDispatchMode

from tests.launch import spawn
from torchpre.models.llama3.args import LLAMA3_FLAVORS
from torchpre.models.llama3.model import Transformer
from torchpre.models.llama3.parallelize import apply_llama3_tensor_parallel
from torchpre.parallel.activation_checkpoint import apply_activation_checkpointing, slots

pytestmark = pytest.mark.slow

ARGS = dataclasses.replace(LLAMA3_FLAVORS["tiny"], vocab_size=128, max_seq_len=16)  # dim 64, 2 blocks
BATCH, SEQ = 2, 16
REDUCE_SCATTER = torch.ops._c10d_functional.reduce_scatter_tensor.default
ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default


class CollectiveCounter(TorchDispatchMode):
    """Counts the functional collectives issued while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional":
            self.counts[func] += 1
        return func(*args, **(kwargs or {}))


def backward_collectives(mesh: DeviceMesh, sequence_parallel: bool, mode: str) -> Counter:
    """The collectives of the tiny model's backward under tp2, with every block checkpointed per `mode`."""
    with torch.device("meta"):
        model = Transformer(ARGS)
    apply_llama3_tensor_parallel(model, mesh, sequence_parallel=sequence_parallel, loss_parallel=False)
    model.to_empty(device="cpu")
    model.init_weights(0)
    apply_activation_checkpointing(slots(model.layers), mode, "op")
    tokens = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    loss = model(tokens).square().mean()
    with CollectiveCounter() as counter:
        loss.backward()
    return counter.counts


def _check(mesh: DeviceMesh) -> None:
    for sequence_parallel, saved in ((True, REDUCE_SCATTER), (False, ALL_REDUCE)):
        none, full, op = (backward_collectives(mesh, sequence_parallel, mode) for mode in ("none", "full", "selective"))
        where = f"sequence_parallel={sequence_parallel}"
        # Recompute re-runs the one after attention in each block; it stops before the feed-forward's, whose output
        # backward does not need (checkpoint's early stop).
        assert full[saved] == none[saved] + ARGS.n_layers, (where, none, full)
        assert op[saved] == none[saved], (where, none, op)
        if sequence_parallel:
            assert op[ALL_GATHER] == full[ALL_GATHER] > none[ALL_GATHER], (where, none, full, op)


def test_op_selective_checkpointing_does_not_rerun_saved_collectives(tmp_path: Path) -> None:
    spawn(_check, world_size=2, store_path=tmp_path / "store")
