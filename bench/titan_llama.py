"""torchtitan 0.3.0 on the same Llama 3 shapes, tokens and batch as torchpre, without network or tokenizer.

torchtitan 0.3.0 configures a run with Python config functions (`--module M --config F`, then `--section.key value`
overrides parsed by tyro; pytorch/torchtitan#2386). This module is such an `M`: one config function per torchpre
flavor, `torchpre_<flavor>` (and `torchpre_<flavor>_untied`), each torchtitan's own llama3 training config (its
`Llama3Model`, parallelisation, compile, mixed precision, AdamW and training loop) with four changes that make it the
run torchpre makes:
- torchpre's flavor dimensions (torchtitan has no `tiny`; the output projection tied to the embedding where the
  flavor ties it, as Llama 3.2 1B/3B do);
- the attention kernel: torchtitan's own `ScaledDotProductAttention` module (causal), which its trainer still takes
  for a model without document masks, instead of FlexAttention, the default for language models since
  pytorch/torchtitan#3571 (2026-06-09). torchpre runs SDPA too, and FlexAttention has no backward on CPU;
- uniformly random tokens in [0, vocab_size) instead of a tokenizer and a Hugging Face dataset, and no tokenizer;
- a metrics.jsonl (tokens/s, peak memory and loss per logged step) in the dump folder.

    python -m torchtitan.train --module bench.titan_llama --config torchpre_1B --training.seq_len 4096 ...
                                               (torchtitan's own entry point and flags; under torchrun)
    python -m bench.titan_llama --check --config torchpre_1B ...   (CPU: parse the flags, build the flavor on meta,
                                               compare its parameter count with torchpre's, one tiny step on CPU)
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import IterableDataset


def _stub_hf_datasets() -> None:
    """torchtitan's llama3 configs import Hugging Face `datasets` for their text loaders, which this module replaces;
    the GPU machine has no `datasets` (and its pinned pyarrow/fsspec), so an empty stand-in satisfies the import where
    the real package is absent."""
    if importlib.util.find_spec("datasets") is not None:
        return
    stub, distributed = types.ModuleType("datasets"), types.ModuleType("datasets.distributed")
    stub.Dataset, stub.load_dataset = object, None
    distributed.split_dataset_by_node = None
    stub.distributed = distributed
    sys.modules.update({"datasets": stub, "datasets.distributed": distributed})


_stub_hf_datasets()

from torchtitan.components.dataloader import ParallelAwareDataloader  # noqa: E402
from torchtitan.components.metrics import BaseLogger, LoggerContainer  # noqa: E402
from torchtitan.components.quantization import Float8LinearConverter  # noqa: E402
from torchtitan.components.tokenizer import BaseTokenizer  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.models import llama3  # noqa: E402
from torchtitan.models.common import ComplexRoPE, compute_ffn_hidden_dim  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.llama3 import config_registry  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from bench.titan_config import FLOAT8_RECIPES, config_name  # noqa: E402
from torchpre.models.llama3.args import LLAMA3_FLAVORS, TransformerArgs  # noqa: E402
from torchpre.models.llama3.model import Transformer as TorchpreTransformer  # noqa: E402

MODULE = "bench.titan_llama"  # what --module names, also when this file runs as __main__


def model_config(args: TransformerArgs, tied: bool) -> llama3.Llama3Model.Config:
    """torchtitan's Llama 3 config (its debugmodel's, with its initialisation) at one of torchpre's flavors: same
    dims, heads, FFN rounding, RoPE theta and scaling; causal SDPA as the attention kernel."""
    head_dim = args.dim // args.n_heads
    scaling = args.rope_scaling
    rope = ComplexRoPE.Config(
        dim=head_dim,
        max_seq_len=args.max_seq_len,
        theta=args.rope_theta,
        **({"scaling": "llama", "scaling_factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings}
           if scaling is not None else {"scaling": "none"}),
    )  # fmt: skip
    base = llama3.llama3_configs["debugmodel"](attn_backend="flex")
    layers = llama3._build_llama3_layers(
        n_layers=args.n_layers,
        dim=args.dim,
        n_heads=args.n_heads,
        n_kv_heads=args.n_kv_heads,
        hidden_dim=compute_ffn_hidden_dim(
            args.dim, multiple_of=args.multiple_of, ffn_dim_multiplier=args.ffn_dim_multiplier
        ),
        rope=rope,
        attn_backend="flex",
    )
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return dataclasses.replace(
        base,
        dim=args.dim,
        vocab_size=args.vocab_size,
        enable_weight_tying=tied,
        # A tied table is initialised as the output projection, as torchtitan's own tied 1B and 3B do.
        tok_embeddings=dataclasses.replace(base.tok_embeddings, num_embeddings=args.vocab_size, embedding_dim=args.dim,
                                           **({"param_init": llama3._EMBEDDING_SKIP_INIT} if tied else {})),
        norm=dataclasses.replace(base.norm, normalized_shape=args.dim, eps=args.norm_eps),
        lm_head=dataclasses.replace(base.lm_head, in_features=args.dim, out_features=args.vocab_size),
        layers=layers,
    )


class SyntheticTokens(IterableDataset):
    """Endless (input, label) pairs of uniformly random tokens, seeded per data-parallel rank."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int) -> None:
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed)
        while True:
            tokens = torch.randint(self.vocab_size, (self.seq_len + 1,), generator=generator)
            yield {"input": tokens[:-1]}, tokens[1:]


class SyntheticLoader(ParallelAwareDataloader):
    """torchtitan's data-parallel-aware loader over `SyntheticTokens`."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        vocab_size: int = 2048

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, seq_len: int, local_batch_size: int,
                 **_: object) -> None:  # fmt: skip
        dataset = SyntheticTokens(config.vocab_size, seq_len, seed=dp_rank)
        super().__init__(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=local_batch_size)


class NoTokenizer(BaseTokenizer):
    """The tokenizer a run on synthetic tokens needs: none (torchtitan builds one from its asset folder otherwise)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config, **_: object) -> None:
        super().__init__()

    def encode(self, *args: object, **kwargs: object) -> list[int]:
        raise NotImplementedError("synthetic tokens are never encoded")

    def decode(self, *args: object, **kwargs: object) -> str:
        raise NotImplementedError("synthetic tokens are never decoded")

    def get_vocab_size(self) -> int:
        raise NotImplementedError("the vocabulary size is the flavor's")


class JsonlLogger(BaseLogger):
    """Each logged step's tokens/s, peak memory and loss, as torchpre's metrics.jsonl names them."""

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

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pass

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            loggers = LoggerContainer()
            loggers.add_logger(self.metrics_processor.logger)
            loggers.add_logger(JsonlLogger(Path(config.dump_folder) / "metrics.jsonl"))
            self.metrics_processor.logger = loggers


def training_config(flavor: str, tied: bool, float8: str = "") -> BenchTrainer.Config:
    """torchtitan's llama3 debug-model training config with the flavor's model, synthetic tokens and no tokenizer,
    validation or checkpoint; every field stays overridable from the command line. With `float8`, the blocks' linears
    in that recipe and the output projection left in high precision, as torchpre leaves it (compiled runs only: the
    converter is told the model is compiled)."""
    args = LLAMA3_FLAVORS[flavor]
    base = config_registry.llama3_debugmodel()
    model = model_config(args, tied)
    if float8:
        # Emulated in eager mode where there is no GPU (the CPU check builds the config; no CPU trains the flavor).
        gpu = torch.cuda.is_available()
        converter = Float8LinearConverter.Config(recipe_name=float8, filter_fqns=["lm_head"], model_compile_enabled=gpu,
                                                 emulate=not gpu)  # fmt: skip
        model = converter.build().convert(model)
    spec = dataclasses.replace(llama3.model_registry("debugmodel"), flavor=flavor, model=model)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(Trainer.Config) if f.init}
    config = BenchTrainer.Config(**fields)
    config.model_spec = spec
    config.loss.loss_fn.global_vocab_size = args.vocab_size
    config.dataloader = SyntheticLoader.Config(vocab_size=args.vocab_size)
    config.tokenizer = NoTokenizer.Config()
    config.validator.enable = False
    config.checkpoint.enable = False
    return config


def _config_function(flavor: str, tied: bool, float8: str):
    def function() -> BenchTrainer.Config:
        return training_config(flavor, tied, float8)

    function.__name__ = config_name(flavor, not tied and LLAMA3_FLAVORS[flavor].tie_word_embeddings, float8)
    return function


# The config functions, as torchtitan's --config looks them up (config_name): torchpre_<flavor> ties the output
# projection where the flavor does, its _untied twin does not (FSDP cannot shard a tied weight whole).
for _flavor, _args in LLAMA3_FLAVORS.items():
    for _tied in {_args.tie_word_embeddings, False}:
        for _float8 in ("", *FLOAT8_RECIPES):
            _function = _config_function(_flavor, _tied, _float8)
            globals()[_function.__name__] = _function


def check(argv: list[str]) -> None:
    """What can be proven without a GPU: torchtitan accepts the flags, builds the flavor on meta with torchpre's
    parameter count, the loader yields the batch shape, and a tiny model of the same code trains one step on CPU."""
    config = ConfigManager().parse_args(["--module", MODULE, *argv])
    flavor = config.model_spec.flavor
    args = LLAMA3_FLAVORS[flavor]
    with torch.device("meta"):
        titan = config.model_spec.model.build()
        ours = TorchpreTransformer(args)
    titan_count = sum(p.numel() for p in titan.parameters())
    ours_count = sum(p.numel() for p in ours.parameters())
    untied = args.tie_word_embeddings and not config.model_spec.model.enable_weight_tying
    expected = ours_count + (args.vocab_size * args.dim if untied else 0)  # an untied copy has its own output matrix
    assert titan_count == expected, f"torchtitan {titan_count:,} != torchpre {ours_count:,} parameters"
    print(f"check: flavor {flavor}{' untied' if untied else ''}: {titan_count:,} parameters "
          f"(torchpre {ours_count:,}), flags accepted")  # fmt: skip
    loader = config.dataloader.build(dp_world_size=1, dp_rank=0, seq_len=config.training.seq_len,
                                     local_batch_size=config.training.local_batch_size)  # fmt: skip
    inputs, labels = next(iter(loader))
    batch = (config.training.local_batch_size, config.training.seq_len)
    assert inputs["input"].shape == labels.shape == batch, f"batch {tuple(labels.shape)}, expected {batch}"
    assert int(labels.max()) < args.vocab_size and torch.equal(inputs["input"][:, 1:], labels[:, :-1])
    _tiny_step()


def _tiny_step() -> None:
    model = model_config(LLAMA3_FLAVORS["tiny"], tied=True).build()
    model.init_states(buffer_device=torch.device("cpu"))
    inputs, labels = next(iter(SyntheticTokens(LLAMA3_FLAVORS["tiny"].vocab_size, 32, seed=0)))
    logits = model(inputs["input"][None])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels)
    loss.backward()
    assert model.lm_head.weight.grad is model.tok_embeddings.weight.grad, "tied weight lost its tie"
    print(f"check: tiny step on CPU, loss {loss.item():.3f}")


if __name__ == "__main__":
    if "--check" not in sys.argv:
        sys.exit("usage: python -m bench.titan_llama --check --config torchpre_FLAVOR [flags] (to train: "
                 "python -m torchtitan.train --module bench.titan_llama --config torchpre_FLAVOR [flags])")
    check([a for a in sys.argv[1:] if a != "--check"])
