"""torchtitan on the same Llama 3.2 shapes, tokens and batch as torchpre, without network or tokenizer.

torchtitan 0.2.2's llama3 has no 1B/3B flavor, no tied embeddings and only Hugging Face text datasets (C4,
or `tests/assets/c4_test`, which the wheel does not ship). This module registers a train spec,
`torchpre_llama3`, that differs from torchtitan's own llama3 spec in three places only: torchpre's flavors
(same dims; tied embeddings as in Llama 3.2 on one rank), uniformly random tokens in [0, vocab_size) instead
of a tokenizer and a dataset, and a metrics.jsonl (tokens/s, peak memory per step) in `job.dump_folder`.
Everything else, parallelism, compile, AMP, the optimizer and the training loop, is torchtitan's.

    python -m bench.titan_llama --model.flavor 1B --training.seq_len 4096 ...   (torchtitan's own flags;
                                               under torchrun, which torchtitan needs; --untied for FSDP)
    python -m bench.titan_llama --check ...   (CPU: parse the flags, build the model on meta, compare its
                                               parameter count with torchpre's, one tiny step on CPU)
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
import types
from pathlib import Path

import torch
from torch.utils.data import IterableDataset

from torchpre.models.llama3.args import LLAMA3_FLAVORS, TransformerArgs

SPEC_NAME = "torchpre_llama3"


def _stub_hf_datasets() -> None:
    """torchtitan's llama3 module imports Hugging Face `datasets` for its text loaders, which this spec
    replaces; the GPU machine has no `datasets` (and its pinned pyarrow/fsspec), so an empty stand-in
    satisfies the import when the real package is absent."""
    if importlib.util.find_spec("datasets") is not None:
        return
    stub, distributed = types.ModuleType("datasets"), types.ModuleType("datasets.distributed")
    stub.Dataset, stub.load_dataset = object, None
    distributed.split_dataset_by_node = None
    stub.distributed = distributed
    sys.modules.update({"datasets": stub, "datasets.distributed": distributed})


def _pop_flag(flag: str) -> bool:
    """Takes one of this module's own flags out of sys.argv, before torchtitan is imported: its config
    parser binds sys.argv[1:] as a default argument at import time and rejects flags it does not know."""
    present = flag in sys.argv
    if present:
        sys.argv.remove(flag)
    return present


_stub_hf_datasets()
CHECK, UNTIED = (_pop_flag("--check"), _pop_flag("--untied")) if __name__ == "__main__" else (False, False)

from torchtitan.components.dataloader import ParallelAwareDataloader  # noqa: E402
from torchtitan.components.metrics import BaseLogger, LoggerContainer  # noqa: E402
from torchtitan.config import ConfigManager, JobConfig  # noqa: E402
from torchtitan.models import llama3  # noqa: E402
from torchtitan.protocols.train_spec import register_train_spec  # noqa: E402
from torchtitan.train import Trainer, main  # noqa: E402


def titan_args(args: TransformerArgs) -> llama3.TransformerModelArgs:
    """torchtitan's model args for one of torchpre's Llama 3 flavors: same FFN rounding, heads and RoPE theta
    (torchtitan's fixed RoPE scaling only changes a precomputed buffer, not the work)."""
    return llama3.TransformerModelArgs(
        dim=args.dim,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        n_kv_heads=args.n_kv_heads,
        vocab_size=args.vocab_size,
        multiple_of=args.multiple_of,
        ffn_dim_multiplier=args.ffn_dim_multiplier,
        norm_eps=args.norm_eps,
        rope_theta=args.rope_theta,
    )


class TiedTransformer(llama3.Transformer):
    """torchtitan's Llama 3 with the output projection sharing the embedding table (Llama 3.2 1B/3B).
    Only for one rank: FSDP would shard the two modules' shared weight in different groups."""

    def __init__(self, model_args: llama3.TransformerModelArgs) -> None:
        super().__init__(model_args)
        self.output.weight = self.tok_embeddings.weight


class SyntheticTokens(IterableDataset):
    """Endless (input, label) pairs of uniformly random tokens, seeded per data-parallel rank."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int) -> None:
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed)
        while True:
            tokens = torch.randint(self.vocab_size, (self.seq_len + 1,), generator=generator)
            yield {"input": tokens[:-1]}, tokens[1:]


def build_synthetic_dataloader(dp_world_size: int, dp_rank: int, tokenizer, job_config: JobConfig, **_):
    vocab_size = LLAMA3_FLAVORS[job_config.model.flavor].vocab_size
    dataset = SyntheticTokens(vocab_size, job_config.training.seq_len, seed=dp_rank)
    return ParallelAwareDataloader(
        dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=job_config.training.local_batch_size
    )


def _flavors() -> dict[str, llama3.TransformerModelArgs]:
    return {name: titan_args(args) for name, args in LLAMA3_FLAVORS.items()}


class JsonlLogger(BaseLogger):
    """Each logged step's tokens/s and peak memory, as torchpre's metrics.jsonl names them."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("w")

    def log(self, metrics: dict, step: int) -> None:
        record = {
            "step": step,
            "tokens_per_sec": metrics["throughput(tps)"],
            "max_memory_bytes": int(metrics["memory/max_active(GiB)"] * 2**30),
            "max_reserved_bytes": int(metrics["memory/max_reserved(GiB)"] * 2**30),
            "loss": float(metrics["loss_metrics/global_avg_loss"]),
        }
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class BenchTrainer(Trainer):
    """torchtitan's Trainer, also writing metrics.jsonl on rank 0."""

    def __init__(self, job_config: JobConfig) -> None:
        super().__init__(job_config)
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            # torchtitan's logger is a bare BaseLogger when neither TensorBoard nor W&B is on: keep it beside ours.
            loggers = LoggerContainer()
            loggers.add_logger(self.metrics_processor.logger)
            loggers.add_logger(JsonlLogger(Path(job_config.job.dump_folder) / "metrics.jsonl"))
            self.metrics_processor.logger = loggers


def register(tied: bool) -> None:
    """The `torchpre_llama3` train spec: torchtitan's llama3 spec with torchpre's flavors and synthetic data."""
    spec = dataclasses.replace(
        llama3.get_train_spec(),
        model_cls=TiedTransformer if tied else llama3.Transformer,
        model_args=_flavors(),
        build_dataloader_fn=build_synthetic_dataloader,
        build_tokenizer_fn=None,
        build_validator_fn=None,
    )
    register_train_spec(SPEC_NAME, spec)


def check(argv: list[str]) -> None:
    """What can be proven without a GPU: torchtitan accepts the flags, builds the flavor on meta with
    torchpre's parameter count, the data loader yields the batch shape, and a tiny model of the same code
    trains one step on CPU."""
    from torchpre.models.llama3.model import Transformer as TorchpreTransformer

    config = ConfigManager().parse_args(argv)
    assert config.model.name == SPEC_NAME, f"--model.name must be {SPEC_NAME}"
    args = LLAMA3_FLAVORS[config.model.flavor]
    with torch.device("meta"):
        titan = TiedTransformer(titan_args(args)) if args.tie_word_embeddings else llama3.Transformer(titan_args(args))
        ours = TorchpreTransformer(args)
    titan_count = sum(p.numel() for p in titan.parameters())
    ours_count = sum(p.numel() for p in ours.parameters())
    assert titan_count == ours_count, f"torchtitan {titan_count:,} != torchpre {ours_count:,} parameters"
    print(f"check: flavor {config.model.flavor}: {titan_count:,} parameters in both, flags accepted")
    inputs, labels = next(iter(build_synthetic_dataloader(1, 0, None, config)))
    batch = (config.training.local_batch_size, config.training.seq_len)
    assert inputs["input"].shape == labels.shape == batch, f"batch {tuple(labels.shape)}, expected {batch}"
    assert int(labels.max()) < args.vocab_size and torch.equal(inputs["input"][:, 1:], labels[:, :-1])
    _tiny_step(config)


def _tiny_step(config: JobConfig) -> None:
    tiny = dataclasses.replace(titan_args(LLAMA3_FLAVORS["tiny"]), max_seq_len=32)
    model = TiedTransformer(tiny)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    inputs, labels = next(iter(SyntheticTokens(tiny.vocab_size, 32, seed=0)))
    loss = llama3.build_cross_entropy_loss(config)(model(inputs["input"][None]), labels[None])
    loss.backward()
    assert model.output.weight.grad is model.tok_embeddings.weight.grad, "tied weight lost its tie"
    print(f"check: tiny step on CPU, loss {loss.item():.3f}")


if __name__ == "__main__":
    register(tied=not UNTIED)
    check(sys.argv[1:]) if CHECK else main(BenchTrainer)
