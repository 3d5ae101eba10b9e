"""train.py, then every rank saves its parameters (TP shards gathered) to {dump_folder}/params_rank{R}.pt, its
persistent buffers (training state outside the optimizer, e.g. MoE routing biases) to buffers_rank{R}.pt, and its
parametrization (each parameter's optimizer group settings, each module's multipliers) to parametrization_rank{R}.pt.

Run like train.py (`torchrun ... tests/train_and_dump.py --section.key value ...`); tests compare the
saved parameters of two layouts after training.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchpre.runtime.cli import run_entry_point  # noqa: E402


def main(argv: list[str]) -> None:
    from torchpre.config.job_config import JobConfig
    from torchpre.config.parser import parse_args
    from torchpre.distributed.names import canonical_fqn
    from torchpre.training.trainer import Trainer

    config = parse_args(JobConfig, argv)
    trainer = Trainer(config)
    trainer.train()
    params = {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone()
        for part in trainer.job.model.parts
        for name, p in part.named_parameters()
    }
    torch.save(params, Path(config.job.dump_folder) / f"params_rank{dist.get_rank()}.pt")
    buffers = {
        name: value.detach().clone()
        for part in trainer.job.model.parts
        for name, value in part.state_dict(keep_vars=True).items()
        if not isinstance(value, torch.nn.Parameter)  # a tied weight's second name is a parameter, not a buffer
    }
    torch.save(buffers, Path(config.job.dump_folder) / f"buffers_rank{dist.get_rank()}.pt")
    groups = {
        name: {key: group[key] for key in ("initial_lr", "weight_decay", "eps") if key in group}
        for group in trainer.job.optimizer.inner.param_groups
        for name in group["names"]
    }
    multipliers = {
        f"{canonical_fqn(name)}.{attribute}": getattr(module, attribute)
        for part in trainer.job.model.parts
        for name, module in part.named_modules()
        for attribute in ("query_multiplier", "query_scale", "residual_multiplier")
        if hasattr(module, attribute)
    }
    parametrization = getattr(trainer.job.preflight.model_args, "parametrization", None)  # none: model.name = 'hf'
    if parametrization is not None:
        multipliers |= {"logits": parametrization.logit_multiplier, "embedding": parametrization.embedding_multiplier}
    path = Path(config.job.dump_folder) / f"parametrization_rank{dist.get_rank()}.pt"
    torch.save({"groups": groups, "multipliers": multipliers}, path)


if __name__ == "__main__":
    run_entry_point(main, sys.argv[1:], prog="tests/train_and_dump.py")
