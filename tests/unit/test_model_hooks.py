"""The trainer reaches a model family only through its `ModelSpec` hooks: a toy family whose hooks record their
calls is trained in this process (one rank) and each hook is seen called with what it should get, its extra
metrics reach metrics.jsonl, and its auxiliary loss reaches the gradient but not the logged loss."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from torchpre.config.job_config import JobConfig
from torchpre.config.parser import parse_args
from torchpre.distributed.parallel_dims import ParallelDims
from torchpre.distributed.process_groups import shutdown_distributed
from torchpre.models import registry
from torchpre.models.aux_loss import AddAuxLoss
from torchpre.models.init import InitRule, ParamInit, ones
from torchpre.models.llama3.model import Transformer
from torchpre.models.llama3.spec import SPEC as LLAMA3_SPEC
from torchpre.models.registry import TrainingHooks
from torchpre.training.trainer import Trainer

LOCAL_BATCH, GLOBAL_BATCH, STEPS = 2, 4, 2  # two microbatches per step: the aux terms must add up over them


class AuxTransformer(Transformer):
    """Llama 3 plus one parameter, `aux_weight`, that only an auxiliary loss uses: each microbatch adds
    `aux_scale * batch * aux_weight`, so with the trainer's scale (1 / global batch) its gradient is exactly 1
    per step, and 0 without it."""

    aux_scale = 0.0

    def __init__(self, args) -> None:
        super().__init__(args)
        self.aux_weight = nn.Parameter(torch.empty(1))

    def param_init_rule(self) -> InitRule:
        llama = super().param_init_rule()
        return lambda fqn: ParamInit(fqn, ones) if fqn == "aux_weight" else llama(fqn)

    def forward(self, tokens: Tensor, **kwargs) -> Tensor:
        out = super().forward(tokens, **kwargs)
        if self.training and torch.is_grad_enabled():
            out = AddAuxLoss.apply(out, self.aux_scale * tokens.shape[0] * self.aux_weight.sum())
        return out


CALLS: dict[str, list[tuple]] = {}


def validate_layout(args, dims: ParallelDims) -> None:
    CALLS["validate_layout"].append((args, dims))


def set_aux_loss_scale(part: nn.Module, scale: float) -> None:
    CALLS["set_aux_loss_scale"].append((part, scale))
    part.aux_scale = scale


def extra_metrics(parts, args, device: torch.device) -> dict[str, float]:
    CALLS["extra_metrics"].append((parts, args, device))
    return {"toy/calls": float(len(CALLS["extra_metrics"]))}


_AUX_BUILD = dataclasses.replace(LLAMA3_SPEC.build, model_cls=AuxTransformer)
HOOKED = dataclasses.replace(
    LLAMA3_SPEC,
    build=_AUX_BUILD,
    parallel=dataclasses.replace(LLAMA3_SPEC.parallel, validate_layout=validate_layout),
    hooks=TrainingHooks(set_aux_loss_scale=set_aux_loss_scale, extra_metrics=extra_metrics),
)
PLAIN = dataclasses.replace(LLAMA3_SPEC, build=_AUX_BUILD)  # the default hooks: no aux loss, no metrics


@pytest.fixture(autouse=True)
def toy_models(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registers the toy families in a copy of the registry, so no other test sees them."""
    registry.get_model_spec("llama3")  # the built-in families first
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_REGISTERED_AT", dict(registry._REGISTERED_AT))
    registry.register_model("toy-hooked", HOOKED)
    registry.register_model("toy-plain", PLAIN)
    CALLS.clear()
    CALLS.update(validate_layout=[], set_aux_loss_scale=[], extra_metrics=[])


def train(name: str, folder: Path) -> tuple[Trainer, list[dict]]:
    config = parse_args(JobConfig, [
        "--model.name", name,
        "--model.flavor", "tiny",
        "--training.seq_len", "32",
        "--training.local_batch_size", str(LOCAL_BATCH),
        "--training.global_batch_size", str(GLOBAL_BATCH),
        "--training.steps", str(STEPS),
        "--metrics.log_freq", "1",
        "--metrics.peak_flops", "1e12",
        "--job.dump_folder", str(folder),
    ])
    try:
        trainer = Trainer(config)
        trainer.train()
    finally:
        shutdown_distributed()
    return trainer, [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_the_trainer_calls_every_hook(tmp_path: Path) -> None:
    trainer, records = train("toy-hooked", tmp_path)

    [(args, dims)] = CALLS["validate_layout"]
    job = trainer.job
    assert args == job.preflight.model_args and args.vocab_size == job.preflight.tokenizer.vocab_size  # resolved
    assert (dims.dp, dims.tp, dims.pp, dims.ep) == (1, 1, 1, 1)

    assert [(part, scale) for part, scale in CALLS["set_aux_loss_scale"]] == [
        (part, 1 / GLOBAL_BATCH) for part in job.model.parts
    ]

    assert len(CALLS["extra_metrics"]) == STEPS  # once per logged step, on every rank
    parts, args, device = CALLS["extra_metrics"][0]
    assert list(parts) == list(job.model.parts) and args == job.preflight.model_args and device == job.device
    assert [r["toy/calls"] for r in records] == [1.0, 2.0]


def test_the_aux_loss_reaches_the_gradient_not_the_logged_loss(tmp_path: Path) -> None:
    """aux_weight's gradient is exactly 1 with the hook and 0 without, and no other gradient changes, so the
    squared global norms differ by 1. Their fp32 sums of ~1e3 terms of size ~1 agree to ~1e-6 relative: 1e-4
    absolute is rounding, while a missing, doubled or per-microbatch-unscaled aux term is off by 1 or more."""
    _, hooked = train("toy-hooked", tmp_path / "hooked")
    _, plain = train("toy-plain", tmp_path / "plain")
    assert hooked[0]["grad_norm"] ** 2 - plain[0]["grad_norm"] ** 2 == pytest.approx(1.0, abs=1e-4)
    assert hooked[0]["loss"] == plain[0]["loss"]  # the logged loss is the language model's alone
    assert "toy/calls" not in plain[0]
