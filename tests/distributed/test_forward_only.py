"""`ParallelModel.forward_only`, the one forward path of validation and generation, built by the trainer's
code (`torchpre.assembly` + `parallelize`): under tp2 and pp2 (one stage per rank, interleaved virtual stages,
a V) its loss and logits equal one process's."""

import dataclasses
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
from torchpre.errors import ConfigError
from torchpre.models.llama3.args import TransformerArgs
from torchpre.models.registry import get_model_spec
from torchpre.parallel.api import parallelize
from torchpre.parallel.pipeline import PipelinePlan

pytestmark = pytest.mark.slow

ARGS = TransformerArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32, max_seq_len=16)
SEED = 5
# name: (tp, pp, schedule, stages per rank)
LAYOUTS = {
    "tp2": (2, 1, "1F1B", 1),
    "pp2_gpipe": (1, 2, "GPipe", 1),
    "pp2_1f1b": (1, 2, "1F1B", 1),
    "pp2_interleaved": (1, 2, "Interleaved1F1B", 2),
    "pp2_v": (1, 2, "ZBVZeroBubble", 2),
}
# fp32 on CPU: the layouts compute the same sums in another order (TP partial sums, per-microbatch matmuls),
# ~1e-7 relative. A missing stage, a wrong microbatch or a lost sum moves a summed loss of ~350 by far more.
LOGITS_ATOL, LOSS_RTOL = 1e-5, 1e-6


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, ARGS.vocab_size, (4, ARGS.max_seq_len + 1), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1], tokens[:, 1:]


def reference() -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, summed loss) of the whole model in one process, built the same way."""
    spec = get_model_spec("llama3")
    model = meta_model(JobConfig(), spec, ARGS)
    model.to_empty(device="cpu")
    spec.build.init_weights(model, SEED)
    inputs, labels = batch()
    with torch.no_grad():
        logits = model(inputs)
    return logits, cross_entropy_sum(logits, labels)


def run_layouts(out: Path, mesh) -> None:
    spec, inputs, labels = get_model_spec("llama3"), *batch()
    results = {}
    for name, (tp, pp, schedule, per_rank) in LAYOUTS.items():
        config = JobConfig()
        config.parallelism = dataclasses.replace(
            config.parallelism, tensor_parallel_degree=tp, pipeline_parallel_degree=pp
        )
        pipeline = None
        if pp > 1:
            stages = spec.pipeline_stages(ARGS, pp * per_rank)
            pipeline = PipelinePlan.build(stages, pp, schedule=schedule, n_microbatches=4)
        model = parallelize(
            meta_model(config, spec, ARGS),
            ParallelDims.from_degrees(dp=1, tp=tp, pp=pp, world_size=2).build_mesh("cpu"),
            parallel_plan(config, spec, ARGS, pipeline),
            device=torch.device("cpu"),
            init_weights=lambda part: spec.build.init_weights(part, SEED),
            loss_fn=cross_entropy_sum,
        )
        try:
            loss = model.forward_only(inputs, labels)
        except ConfigError as error:  # a schedule that cannot run forward-only says so
            loss = str(error)
        results[name] = {"loss": loss, "logits": model.forward_only(inputs), "last": model.last_stage_rank}
    torch.save(results, out / f"rank{dist.get_rank()}.pt")


def test_forward_only_matches_one_process(tmp_path):
    spawn(functools.partial(run_layouts, tmp_path), 2, tmp_path / "store", timeout_s=300)
    logits, loss = reference()
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    for name, (tp, pp, schedule, _) in LAYOUTS.items():
        last = ranks[0][name]["last"]
        assert last == (0 if schedule == "ZBVZeroBubble" else pp - 1), name  # a V ends where it starts
        for rank, results in enumerate(ranks):
            got = results[name]
            if schedule == "ZBVZeroBubble":  # on every rank, before any work
                assert "cannot run forward-only" in got["loss"], name
            if pp > 1 and rank != last:  # only the last stage holds the output (under tp2 every rank does)
                assert got["logits"] is None, name
                assert got["loss"] is None or schedule == "ZBVZeroBubble", name
                continue
            torch.testing.assert_close(got["logits"], logits, rtol=0, atol=LOGITS_ATOL, msg=name)
            if schedule != "ZBVZeroBubble":
                torch.testing.assert_close(got["loss"], loss, rtol=LOSS_RTOL, atol=0, msg=name)
