"""The whole Llama 3 model under cp2, built by the trainer's code (`parallel_plan` + `parallelize`): each rank's
logits at its head-tail positions and the summed gradients of every parameter equal one process's, so RoPE, the
causal mask and the key/value gather all follow the shard."""

import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.launch import spawn
from torchpre.assembly.meta import meta_model
from torchpre.assembly.plans import parallel_plan
from torchpre.config.job_config import JobConfig
from torchpre.distributed.parallel_dims import ParallelDims
from torchpre.models.llama3.args import TransformerArgs
from torchpre.models.registry import get_model_spec
from torchpre.parallel.api import parallelize
from torchpre.parallel.context_parallel import ContextParallel
from torchpre.training.job import CONTEXT_PARALLEL_KERNELS

pytestmark = pytest.mark.slow

ARGS = TransformerArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32, max_seq_len=32)
SEED, CP = 5, 2
# fp32 on CPU: the same sums in another order (masked instead of causal kernel, k/v gradients summed over the cp
# ranks, the cp ranks' gradient shares added): measured within 2.4e-7 on logits and 1.2e-6 on the gradients of a
# loss summed over 64 tokens. A shard with RoPE at local positions or a mask without the global offset moves
# logits by O(0.1).
LOGITS_ATOL, GRAD_ATOL = 1e-5, 1e-5


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, ARGS.vocab_size, (2, ARGS.max_seq_len + 1), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1], tokens[:, 1:]


def reference_model() -> torch.nn.Module:
    spec = get_model_spec("llama3")
    net = meta_model(JobConfig(), spec, ARGS)
    net.to_empty(device="cpu")
    spec.build.init_weights(net, SEED)
    return net


def context_parallel_model(context_parallel: ContextParallel, mesh) -> torch.nn.Module:
    spec = get_model_spec("llama3")
    return parallelize(
        meta_model(JobConfig(), spec, ARGS),
        mesh,
        parallel_plan(JobConfig(), spec, ARGS, None, context_parallel=context_parallel),
        device=torch.device("cpu"),
        init_weights=lambda part: spec.build.init_weights(part, SEED),
    ).parts[0]


def logits_and_grads(net, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, dict]:
    logits = net(inputs)
    F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum").backward()
    return logits.detach(), {name: p.grad for name, p in net.named_parameters()}


def run_cp(out: Path, world) -> None:
    meshes = ParallelDims.from_degrees(dp=1, tp=1, pp=1, world_size=CP, cp=CP).build_meshes("cpu")
    cp = ContextParallel(meshes.context_mesh["cp"], ARGS.max_seq_len, torch.device("cpu"), CONTEXT_PARALLEL_KERNELS)
    inputs, labels = cp.shard(batch())
    logits, grads = logits_and_grads(context_parallel_model(cp, meshes.mesh), inputs, labels)
    for grad in grads.values():  # the cp ranks' shares of every gradient, as the data-parallel reduction adds them
        dist.all_reduce(grad)
    torch.save({"positions": cp.positions, "logits": logits, "grads": grads}, out / f"rank{dist.get_rank()}.pt")


def test_model_under_cp2_matches_one_process(tmp_path):
    spawn(functools.partial(run_cp, tmp_path), CP, tmp_path / "store", timeout_s=300)
    logits, grads = logits_and_grads(reference_model(), *batch())
    for rank in range(CP):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(got["logits"], logits[:, got["positions"]], rtol=0, atol=LOGITS_ATOL)
        for name, grad in grads.items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=0, atol=GRAD_ATOL, msg=name)
