"""`training.dataset = "synthetic"` and `model.vocab_size`: seeded random tokens, layout-invariant and resumable
like a corpus, in any vocabulary; and which devices get pinned batches."""

import dataclasses

import pytest
import torch

from torchpre.assembly.args import model_args
from torchpre.config.job_config import JobConfig
from torchpre.config.validate import validate_config
from torchpre.data.loader import build_dataloader, pins_memory
from torchpre.data.synthetic import SyntheticTokens
from torchpre.data.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer
from torchpre.errors import ConfigError

TOKENIZER = load_tokenizer(DEFAULT_TOKENIZER_PATH)
LLAMA3_VOCAB = 128_256
SEQ_LEN = 16


def loader(dp_rank: int = 0, dp_size: int = 1, local_batch_size: int = 4, seed: int = 7, vocab_size: int = 1000):
    return build_dataloader(
        dataset="synthetic",
        dataset_path="",
        tokenizer=TOKENIZER,
        seq_len=SEQ_LEN,
        local_batch_size=local_batch_size,
        global_batch_size=local_batch_size * dp_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=seed,
        vocab_size=vocab_size,
    )


def batches(data, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    it = iter(data)
    return [next(it) for _ in range(count)]


def test_tokens_cover_the_whole_vocabulary_and_labels_are_the_next_tokens():
    samples = SyntheticTokens(SEQ_LEN, LLAMA3_VOCAB, seed=0)
    windows = [samples[i] for i in range(200)]
    tokens = torch.cat([torch.cat([x, y[-1:]]) for x, y in windows])
    assert tokens.dtype == torch.int64 and tokens.min() >= 0 and tokens.max() < LLAMA3_VOCAB
    # 3,400 uniform draws from 128,256 ids: ids above 2,048 (the shipped tokenizer's) are ~98% of them, and the
    # largest falls within the top 1% with probability 1 - 0.99^3400 (> 1 - 1e-14).
    assert tokens.max() > 0.99 * LLAMA3_VOCAB
    for x, y in windows:
        assert torch.equal(x[1:], y[:-1])


def test_a_sample_is_a_function_of_the_seed_and_its_index_alone():
    first, again = SyntheticTokens(SEQ_LEN, 1000, seed=3), SyntheticTokens(SEQ_LEN, 1000, seed=3)
    assert torch.equal(first[12345][0], again[12345][0])
    assert not torch.equal(first[0][0], first[1][0])
    assert not torch.equal(first[0][0], SyntheticTokens(SEQ_LEN, 1000, seed=4)[0][0])
    assert SyntheticTokens(SEQ_LEN, 1000, seed=-1)[0][0].shape == (SEQ_LEN,)  # any int seed


def test_dp_ranks_take_slices_of_the_single_process_global_batch():
    reference = batches(loader(local_batch_size=4), 3)
    ranks = [batches(loader(dp_rank=r, dp_size=2, local_batch_size=2), 3) for r in range(2)]
    for step, (x, y) in enumerate(reference):
        assert torch.equal(torch.cat([ranks[0][step][0], ranks[1][step][0]]), x)
        assert torch.equal(torch.cat([ranks[0][step][1], ranks[1][step][1]]), y)


def test_a_resumed_loader_continues_with_the_same_batches():
    data = loader()
    it = iter(data)
    for _ in range(3):
        next(it)
    state = data.state_dict()
    expected = [next(it) for _ in range(3)]
    resumed = loader()
    resumed.load_state_dict(state)
    for (x, y), (x2, y2) in zip(expected, batches(resumed, 3)):
        assert torch.equal(x, x2) and torch.equal(y, y2)


def test_batches_are_pinned_for_cuda_devices_only():
    assert pins_memory(torch.device("cuda", 1))
    assert not pins_memory(torch.device("cpu"))
    assert not pins_memory(torch.device("meta"))


def config_with(**sections) -> JobConfig:
    config = JobConfig()
    for section, values in sections.items():
        setattr(config, section, dataclasses.replace(getattr(config, section), **values))
    return config


def test_model_vocab_size_overrides_the_tokenizers():
    assert model_args(JobConfig(), TOKENIZER).vocab_size == TOKENIZER.vocab_size  # 0: the tokenizer's
    synthetic = config_with(model={"vocab_size": LLAMA3_VOCAB}, training={"dataset": "synthetic"})
    assert model_args(synthetic, TOKENIZER).vocab_size == LLAMA3_VOCAB
    small = config_with(model={"vocab_size": 100}, training={"dataset": "synthetic"})
    assert model_args(small, TOKENIZER).vocab_size == 100  # random tokens need no room for the tokenizer's ids


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"model": {"vocab_size": 100}}, r"model.vocab_size = 100 is smaller than the tokenizer's 2048 ids"),
        (
            {
                "model": {"vocab_size": 100},
                "training": {"dataset": "synthetic"},
                "validation": {"enable": True, "dataset": "stdlib"},
            },
            r"model.vocab_size = 100 .* validation.dataset = 'stdlib'",
        ),
        ({"model": {"vocab_size": 4096, "name": "hf"}}, r"model.vocab_size = 4096 with model.name = 'hf'"),
    ],
)
def test_a_vocabulary_the_data_does_not_fit_is_refused(sections, message):
    with pytest.raises(ConfigError, match=message):
        model_args(config_with(**sections), TOKENIZER)


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"model": {"vocab_size": -1}}, r"model.vocab_size = -1: it must be at least 0"),
        ({"training": {"dataset": "synthetic", "dataset_path": "x.txt"}}, r"training.dataset = 'synthetic'"),
        (
            {"training": {"dataset": "synthetic"}, "validation": {"enable": True}},
            r"validation.enable with training.dataset = 'synthetic'",
        ),
    ],
)
def test_bad_synthetic_settings_name_the_key(sections, message, tmp_path):
    config = config_with(**sections)
    config.job.dump_folder = str(tmp_path)
    with pytest.raises(ConfigError, match=message):
        validate_config(config)
