"""DeepSeek-V3's multi-token prediction blocks are units of activation checkpointing, compile and FSDP like the
layers: the training job of a rank (built as the dry run builds it, on a fake process group) wraps, compiles and
shards each MTP block on its own, on the pipeline stage that holds it."""

import pytest
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
from torch.distributed.fsdp import FSDPModule

from torchpre.config.job_config import JobConfig
from torchpre.config.parser import parse_args
from torchpre.runtime.world import Runtime
from torchpre.training.job import build_job

DEPTH = 2
JOB = ("--training.dataset", "stdlib", "--model.name", "deepseek_v3", "--model.flavor", "debugmodel",
       "--model.mtp_depth", str(DEPTH), "--training.seq_len", "32", "--training.local_batch_size", "2",
       "--optimizer.zero_stage", "3", "--compile.enable")  # fmt: skip
DP2 = ("--parallelism.data_parallel_degree", "2", "--job.dry_run_world_size", "2")
PP2_DP2 = ("--parallelism.data_parallel_degree", "2", "--parallelism.pipeline_parallel_degree", "2",
           "--parallelism.pipeline_parallel_schedule", "1F1B", "--job.dry_run_world_size", "4")  # fmt: skip


def units(part: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers and the MTP blocks this part holds, as the part holds them now (wrapped, compiled, sharded)."""
    held = [(f"layers.{key}", block) for key, block in part.layers.items()]
    if part.mtp is not None:
        held += [(f"mtp.depths.{key}.block", depth.block) for key, depth in part.mtp.depths.items()]
    return held


def compiled(module: nn.Module) -> bool:
    return getattr(module, "_compiled_call_impl", None) is not None


@pytest.mark.parametrize(
    "layout, rank, mode, expected",
    [
        (DP2, 0, "full", ["layers.0", "layers.1", "layers.2", "mtp.depths.1.block", "mtp.depths.2.block"]),
        (PP2_DP2, 0, "selective", ["layers.0", "layers.1"]),  # the first stage
        (PP2_DP2, 2, "selective", ["layers.2", "mtp.depths.1.block", "mtp.depths.2.block"]),  # the last, with MTP
    ],
    ids=["dp2-zero3-full-ac", "pp2xdp2-zero3-first-stage-selective-ac", "pp2xdp2-zero3-last-stage-selective-ac"],
)
def test_mtp_blocks_are_checkpointed_compiled_and_sharded_like_the_layers(layout, rank, mode, expected):
    config = parse_args(JobConfig, [*JOB, *layout, "--activation_checkpoint.mode", mode])
    job = build_job(config, Runtime(config.job.dry_run_world_size, fake_rank=rank))
    try:
        (part,) = job.model.parts
        held = units(part)
        assert [name for name, _ in held] == expected
        for name, block in held:
            # Selective "op" checkpoints every block too; FSDP shards around the wrapper, compile runs inside it
            # (per child: FSDP's hooks stay eager).
            assert isinstance(block, FSDPModule) and isinstance(block, ActivationWrapper), name
            inner = block._checkpoint_wrapped_module
            assert all(compiled(child) for child in inner.children()), name
        sharded = [module for module in part.modules() if isinstance(module, FSDPModule)]
        assert len(sharded) == len(expected) + 1  # and the part itself, the root unit
        wrappers = [module for module in part.modules() if isinstance(module, ActivationWrapper)]
        assert len(wrappers) == len(expected)
    finally:
        dist.destroy_process_group()
