"""Validation: the held-out split, the fixed validation batches, the evaluation itself and its config keys."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from torchpre.config.job_config import JobConfig, Validation
from torchpre.config.validate import validate_config
from torchpre.data.dataset import PackedWindows, pack_documents
from torchpre.data.documents import load_documents
from torchpre.data.loader import build_dataloader, held_out_samples
from torchpre.data.sampler import EpochShuffle
from torchpre.data.shards import Manifest, write_shard
from torchpre.data.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer
from torchpre.errors import ConfigError
from torchpre.evaluation.validation import (
    Validator,
    check_validation_batches,
    held_out_fraction,
    validation_batches,
)
from torchpre.metrics.logger import format_step_line
from torchpre.models.llama3.args import TransformerArgs
from torchpre.models.llama3.model import Transformer
from torchpre.parallel.api import ParallelModel, ParallelPlan
from torchpre.parallel.pipeline import PipelinePlan

TOKENIZER = load_tokenizer(DEFAULT_TOKENIZER_PATH)
SEQ_LEN = 8


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i}: " + "word " * (i % 7)}) + "\n" for i in range(120)))
    return path


def loader(path, local_batch_size: int = 4, **kwargs):
    return build_dataloader(
        dataset="text",
        dataset_path=str(path),
        tokenizer=TOKENIZER,
        seq_len=SEQ_LEN,
        local_batch_size=local_batch_size,
        global_batch_size=local_batch_size,
        dp_rank=0,
        dp_size=1,
        seed=3,
        vocab_size=TOKENIZER.vocab_size,
        **kwargs,
    )


def held_out(fraction: float, **source):
    return held_out_samples(
        **source, tokenizer=TOKENIZER, seq_len=SEQ_LEN, seed=3, fraction=fraction, vocab_size=TOKENIZER.vocab_size
    )


def text(path) -> dict[str, str]:
    return {"dataset": "text", "dataset_path": str(path)}


def window(sample: tuple[torch.Tensor, torch.Tensor]) -> tuple[int, ...]:
    inputs, labels = sample
    return (*inputs.tolist(), labels[-1].item())


# ----- the held-out split ----------------------------------------------------------------------------


def test_held_out_windows_are_the_tail_and_training_never_sees_them(text_file):
    all_windows = PackedWindows(pack_documents(load_documents("text", str(text_file)), TOKENIZER), SEQ_LEN)
    n = len(all_windows)
    k = int(np.ceil(0.1 * n))
    samples, order = held_out(0.1, **text(text_file))
    assert [window(samples[i]) for i in range(len(samples))] == [window(all_windows[i]) for i in range(n - k, n)]
    assert sorted(order(p) for p in range(k)) == list(range(k))  # a seeded order over all of them

    train = loader(text_file, local_batch_size=1, held_out_fraction=0.1)
    assert len(train.dataset) == n - k
    # two epochs of training samples: every window before the cut exactly twice, none after it
    batches = iter(train)
    trained = [window((x[0], y[0])) for x, y in (next(batches) for _ in range(2 * (n - k)))]
    assert sorted(trained) == sorted(2 * [window(all_windows[i]) for i in range(n - k)])


def test_without_a_split_the_training_order_is_untouched(text_file):
    default = iter(loader(text_file))
    disabled = iter(loader(text_file, held_out_fraction=held_out_fraction(Validation(enable=False))))
    for _ in range(40):  # past the end of the first epoch
        (x, y), (x2, y2) = next(default), next(disabled)
        assert torch.equal(x, x2) and torch.equal(y, y2)


def test_the_split_applies_only_when_validation_has_no_data_of_its_own():
    assert held_out_fraction(Validation(enable=False, split_fraction=0.2)) == 0.0
    assert held_out_fraction(Validation(enable=True, dataset="stdlib", split_fraction=0.2)) == 0.0
    assert held_out_fraction(Validation(enable=True, split_fraction=0.2)) == 0.2


def write_shard_folder(folder, num_documents: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    documents = [
        [TOKENIZER.bos_id, *rng.integers(0, 2000, rng.integers(1, 30)).tolist(), TOKENIZER.eos_id]
        for _ in range(num_documents)
    ]
    folder.mkdir(parents=True)
    info = write_shard(folder, "shard_00000", documents, TOKENIZER.vocab_size)
    Manifest(TOKENIZER.name, TOKENIZER.sha256, TOKENIZER.vocab_size, [info]).write(folder)
    return str(folder)


def test_a_mixture_holds_out_the_tail_of_every_source(tmp_path):
    mixture = {write_shard_folder(tmp_path / "a", 200, 1): 0.6, write_shard_folder(tmp_path / "b", 90, 2): 0.4}
    train = build_dataloader(
        dataset="shards",
        dataset_path="",
        dataset_mixture=mixture,
        tokenizer=TOKENIZER,
        seq_len=SEQ_LEN,
        local_batch_size=4,
        global_batch_size=4,
        dp_rank=0,
        dp_size=1,
        seed=3,
        held_out_fraction=0.25,
        vocab_size=TOKENIZER.vocab_size,
    )
    samples, order = held_out(0.25, dataset="shards", dataset_path="", dataset_mixture=mixture)
    for trained, kept in zip(train.dataset.datasets, samples.datasets):  # per source, in path order
        n = len(trained.dataset)
        assert list(trained.indices) == list(range(n - int(np.ceil(0.25 * n))))
        assert list(kept.indices) == list(range(len(trained.indices), n))
    # the held-out order draws from every source, with the training weights
    sources = [int(order(p) >= len(samples.datasets[0])) for p in range(400)]
    assert 0.5 < sources.count(0) / 400 < 0.7


def test_a_split_that_leaves_no_training_data_names_the_key(text_file, tmp_path):
    with pytest.raises(ConfigError, match=r"validation.split_fraction = 0.99 holds out .* fewer than one global"):
        loader(text_file, local_batch_size=8, held_out_fraction=0.99)
    with pytest.raises(
        ConfigError, match=r"validation.split_fraction = 0.9 holds out all \d+ samples of the shard folder"
    ):
        build_dataloader(
            dataset="shards",
            dataset_path="",
            dataset_mixture={write_shard_folder(tmp_path / "tiny", 1, 0): 1.0},
            tokenizer=TOKENIZER,
            seq_len=SEQ_LEN,
            local_batch_size=1,
            global_batch_size=1,
            dp_rank=0,
            dp_size=1,
            seed=0,
            held_out_fraction=0.9,
            vocab_size=TOKENIZER.vocab_size,
        )


# ----- the validation batches ------------------------------------------------------------------------


def test_validation_batches_are_fixed_and_sliced_over_dp_like_training():
    single = validation_batches(EpochShuffle(100, 5), 100, steps=3, local_batch_size=8, dp_rank=0, dp_size=1)
    assert single == validation_batches(EpochShuffle(100, 5), 100, steps=3, local_batch_size=8, dp_rank=0, dp_size=1)
    assert len({i for batch in single for i in batch}) == 24  # distinct samples
    per_rank = [validation_batches(EpochShuffle(100, 5), 100, 3, 4, rank, 2) for rank in range(2)]
    assert [per_rank[0][k] + per_rank[1][k] for k in range(3)] == single


def test_more_validation_samples_than_the_data_holds_names_the_keys():
    with pytest.raises(ConfigError, match=r"validation.steps x validation.local_batch_size .* = 30 samples"):
        validation_batches(EpochShuffle(20, 0), 20, steps=5, local_batch_size=3, dp_rank=0, dp_size=2)


# ----- the evaluation --------------------------------------------------------------------------------


def tiny_model() -> Transformer:
    args = TransformerArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=TOKENIZER.vocab_size, max_seq_len=16)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(0)
    return model


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")


def validator(model: Transformer, samples, batches: list[list[int]]) -> Validator:
    whole = ParallelModel([model], None, ParallelPlan(), torch.device("cpu"), cross_entropy_sum, None)
    return Validator(samples, batches, freq=5, model=whole, device=torch.device("cpu"), groups=[])


def test_evaluate_is_the_mean_token_loss_and_leaves_no_trace(text_file):
    samples, order = held_out(0.5, **text(text_file))
    batches = validation_batches(order, len(samples), steps=3, local_batch_size=4, dp_rank=0, dp_size=1)
    model = tiny_model()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    rng = torch.get_rng_state()

    val_loss = validator(model, samples, batches).evaluate()

    inputs = torch.stack([samples[i][0] for batch in batches for i in batch])
    labels = torch.stack([samples[i][1] for batch in batches for i in batch])
    with torch.no_grad():
        expected = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten()).item()
    assert val_loss == pytest.approx(expected, rel=1e-6)
    assert validator(model, samples, batches).evaluate() == val_loss  # the same batches each time
    assert model.training  # back in training mode
    assert torch.equal(torch.get_rng_state(), rng)  # no random numbers drawn (e.g. by a DataLoader)
    for name, p in model.named_parameters():
        assert p.grad is None and torch.equal(p, before[name]), name


def test_pipeline_validation_batches_must_split_into_the_schedules_microbatches():
    """Refused by preflight's step, before any work (not when the validator is built)."""
    pipeline = PipelinePlan.build([["layers.0"], ["layers.1"]], pp=2, schedule="GPipe", n_microbatches=4)
    config = JobConfig()
    config.validation.enable, config.validation.local_batch_size = True, 2
    with pytest.raises(ConfigError, match="validation.local_batch_size = 2: .* 4 microbatches"):
        check_validation_batches(config, pipeline)
    config.validation.local_batch_size = 8
    check_validation_batches(config, pipeline)
    config.validation.enable = False
    config.validation.local_batch_size = 2
    check_validation_batches(config, pipeline)


# ----- config and output -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "validation, parallelism, message",
    [
        ({"steps": 0}, {}, "validation.steps = 0"),
        ({"freq": 0}, {}, "validation.freq = 0"),
        ({"local_batch_size": 0}, {}, "validation.local_batch_size = 0"),
        ({"split_fraction": 1.0}, {}, r"validation.split_fraction = 1.0: .* in \(0, 1\)"),
        ({"split_fraction": 0.0}, {}, "validation.split_fraction = 0.0"),
        ({"enable": True, "dataset": "text"}, {}, "validation.dataset = 'text' needs validation.dataset_path"),
        ({"enable": True, "dataset_path": "x.txt"}, {}, "validation.dataset_path is set but validation.dataset is"),
        ({"enable": True, "dataset": "stdlib"}, {}, "is the training data"),
        ({"enable": True, "dataset": "text", "dataset_path": "no/such.txt"}, {}, "validation.dataset_path 'no/such"),
        ({"enable": True, "dataset": "shards", "dataset_path": "no/dir"}, {}, "validation.dataset_path: the shard"),
        (
            {"enable": True},
            {"pipeline_parallel_degree": 2, "pipeline_parallel_schedule": "DualPipeV"},
            "validation.enable: evaluation cannot run under .* 'DualPipeV'",
        ),
    ],
)
def test_bad_validation_keys_name_the_key(validation, parallelism, message):
    config = JobConfig()
    for key, value in validation.items():
        setattr(config.validation, key, value)
    for key, value in parallelism.items():
        setattr(config.parallelism, key, value)
    with pytest.raises(ConfigError, match=message):
        validate_config(config)


def test_validation_on_other_text_than_the_training_text_is_accepted(text_file, tmp_path):
    config = JobConfig()
    config.training.dataset, config.training.dataset_path = "text", str(text_file)
    config.validation.enable, config.validation.dataset = True, "stdlib"
    validate_config(config)
    config.validation.dataset, config.validation.dataset_path = "text", str(text_file)
    with pytest.raises(ConfigError, match="is the training data"):
        validate_config(config)


def test_the_step_line_shows_val_loss_only_when_evaluated():
    record = {
        "step": 10, "loss": 5.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_sec": 100.0, "mfu": 0.1,
        "max_memory_bytes": 0, "step_time_s": 0.1, "data_time_s": 0.0,
    }  # fmt: skip
    assert "val_loss" not in format_step_line(record)
    assert "| loss 5.0000 | val_loss 4.2500 |" in format_step_line({**record, "val_loss": 4.25})
