"""Training on pre-tokenized shards: windows, weighted mixtures, layout-independent order, loader
workers and exact resume, and the errors for bad shard folders and mixture keys."""

import bisect
import os
import pickle
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.shard_folders import open_descriptors, write_many_shards
from torchpre.config.job_config import JobConfig
from torchpre.config.parser import parse_args
from torchpre.config.validate import validate_config
from torchpre.confined import OpenFolder
from torchpre.data import shards
from torchpre.data.dataset import PackedWindows
from torchpre.data.loader import build_dataloader, data_shares
from torchpre.data.mixture import BLOCK_SIZE, MixtureOrder, Source
from torchpre.data.sampler import GlobalBatchSampler
from torchpre.data.shard_dataset import ShardWindows
from torchpre.data.shards import Manifest, write_shard
from torchpre.data.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer
from torchpre.errors import ConfigError, TorchpreError

TOKENIZER = load_tokenizer(DEFAULT_TOKENIZER_PATH)
SHA256 = TOKENIZER.sha256


def random_documents(num: int, seed: int, max_len: int = 40) -> list[list[int]]:
    """BOS ... EOS framed documents of random ids and lengths."""
    rng = np.random.default_rng(seed)
    body = [rng.integers(0, 2000, rng.integers(0, max_len)).tolist() for _ in range(num)]
    return [[TOKENIZER.bos_id, *ids, TOKENIZER.eos_id] for ids in body]


def write_shard_folder(folder: Path, documents: list[list[int]], shards: int = 3, sha256: str = SHA256) -> Path:
    """A shard folder as prepare writes it: the documents split in order into `shards` shards."""
    bounds = np.linspace(0, len(documents), shards + 1).astype(int)
    return write_shards(folder, [documents[a:b] for a, b in zip(bounds, bounds[1:])], sha256)


def write_shards(folder: Path, parts: list[list[list[int]]], sha256: str = SHA256) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    infos = [write_shard(folder, f"shard_{i:05d}", part, TOKENIZER.vocab_size) for i, part in enumerate(parts)]
    Manifest(DEFAULT_TOKENIZER_PATH.name, sha256, TOKENIZER.vocab_size, infos).write(folder)
    return folder


def build(folder_or_mixture, *, seq_len=8, local_batch_size=2, dp_rank=0, dp_size=1, num_workers=0, seed=0):
    mixture = folder_or_mixture if isinstance(folder_or_mixture, dict) else None
    return build_dataloader(
        dataset="shards",
        dataset_path="" if mixture else str(folder_or_mixture),
        dataset_mixture=mixture,
        tokenizer=TOKENIZER,
        seq_len=seq_len,
        local_batch_size=local_batch_size,
        global_batch_size=local_batch_size * dp_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=seed,
        num_workers=num_workers,
        vocab_size=TOKENIZER.vocab_size,
    )


def take(loader_or_iterator, n: int) -> list:
    iterator = iter(loader_or_iterator)
    return [next(iterator) for _ in range(n)]


def assert_same_batches(a: list, b: list) -> None:
    assert len(a) == len(b)
    for (x, y), (x2, y2) in zip(a, b):
        assert torch.equal(x, x2) and torch.equal(y, y2)


# ----- windows over shards -------------------------------------------------------------------------


@pytest.mark.parametrize("seq_len", [1, 7, 32])
def test_shard_windows_equal_the_windows_of_the_documents_packed_in_memory(tmp_path, seq_len):
    """Windows span document and shard boundaries (an empty shard included) exactly as in-memory packing."""
    documents = random_documents(60, seed=seq_len)
    folder = write_shards(tmp_path, [documents[:25], [], documents[25:40], documents[40:]])
    windows = ShardWindows(str(folder), seq_len, SHA256, TOKENIZER.vocab_size)
    packed = PackedWindows(torch.tensor([t for doc in documents for t in doc]), seq_len)
    assert len(windows) == len(packed) > 0
    for i in range(len(packed)):
        for got, expected in zip(windows[i], packed[i]):
            assert got.dtype == torch.int64 and torch.equal(got, expected)
    with pytest.raises(IndexError):
        windows[len(packed)]


def test_shard_windows_pickle_as_their_folder_not_their_tokens(tmp_path):
    """Loader workers started by spawn reopen the memory maps instead of receiving every token."""
    folder = write_shard_folder(tmp_path, random_documents(400, seed=1))
    windows = ShardWindows(str(folder), 8, SHA256, TOKENIZER.vocab_size)
    data = pickle.dumps(windows)
    assert len(data) < 1000 < windows.num_tokens
    copy = pickle.loads(data)
    assert_same_batches([windows[i] for i in range(len(windows))], [copy[i] for i in range(len(copy))])


def test_wrong_tokenizer_and_truncated_shard_fail_with_the_fix(tmp_path):
    documents = random_documents(50, seed=2)
    other = write_shard_folder(tmp_path / "other", documents, sha256="ab" * 32)
    with pytest.raises(TorchpreError, match=r"made with tokenizer.*model\.tokenizer_path"):
        build(other)
    folder = write_shard_folder(tmp_path / "cut", documents)
    bin_file = folder / "shard_00001.bin"
    bin_file.write_bytes(bin_file.read_bytes()[:-2])
    windows = build(folder).dataset  # a shard is checked when first read, not before training starts
    with pytest.raises(TorchpreError, match=r"shard_00001\.bin.*truncated.*Re-run prepare"):
        [windows[i] for i in range(len(windows))]
    with pytest.raises(TorchpreError, match="no manifest.json"):
        build(tmp_path)


def test_thousands_of_shards_are_read_through_one_folder_descriptor_and_a_bounded_few_of_their_own(
    tmp_path, monkeypatch
):
    """Every window of 3,000 shards, in a seeded random order, equals the concatenated files' tokens, while the reader
    holds at most MAX_OPEN_SHARDS shard descriptors (16 here), opens the folder once and never opens an `.idx`."""
    folder = write_many_shards(tmp_path / "many", 3000, 21, vocab_size=TOKENIZER.vocab_size,
                               tokenizer_name=DEFAULT_TOKENIZER_PATH.name, sha256=SHA256)  # fmt: skip
    monkeypatch.setattr(shards, "MAX_OPEN_SHARDS", 16)
    opened, folders = [], []
    open_file = shards.open_file

    def recording(where, name, *args):
        opened.append((where, name))
        return open_file(where, name, *args)

    monkeypatch.setattr(shards, "open_file", recording)
    monkeypatch.setattr(shards, "OpenFolder", lambda path: folders.append(path) or OpenFolder(path))
    before = open_descriptors()
    windows = ShardWindows(str(folder), 8, SHA256, TOKENIZER.vocab_size)
    stream = np.concatenate([np.fromfile(folder / f"shard_{i:06d}.bin", "<u2") for i in range(3000)]).astype(np.int64)
    for index in np.random.default_rng(0).permutation(len(windows)).tolist():
        inputs, labels = windows[index]
        expected = torch.from_numpy(stream[index * 9 : (index + 1) * 9])
        assert torch.equal(inputs, expected[:-1]) and torch.equal(labels, expected[1:])
        assert open_descriptors() - before <= 16 + 1
    assert folders == [folder] and all(isinstance(where, OpenFolder) for where, _ in opened)
    assert {name[-4:] for _, name in opened} == {".bin"}


def test_the_loader_asks_the_kernel_for_a_whole_batch_of_windows_before_reading_them(tmp_path, monkeypatch):
    """Each window of a batch, shard ends included, is advised (WILLNEED) before any is read; the batch is the
    windows read one by one."""
    folder = write_shard_folder(tmp_path / "s", random_documents(300, seed=4), shards=7)
    events = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, advice: events.append(("advise", length)))
    windows = ShardWindows(str(folder), 8, SHA256, TOKENIZER.vocab_size)
    read = windows.reader.read
    monkeypatch.setattr(windows.reader, "read", lambda *args: events.append(("read",)) or read(*args))
    indices = np.random.default_rng(1).permutation(len(windows))[:16].tolist()
    batch = windows.__getitems__(indices)
    assert_same_batches(batch, [windows[i] for i in indices])
    first_read = events.index(("read",))
    assert sum(length for _, length in events[:first_read]) == 16 * 9 * 2  # every token of the batch, uint16
    loader = build(folder, local_batch_size=4)
    loader.dataset.reader, events[:] = windows.reader, []
    take(loader, 1)
    assert events[0][0] == "advise" and sum(event[0] == "advise" for event in events) >= 4


def test_a_folder_too_small_for_a_global_batch_names_it(tmp_path):
    folder = write_shard_folder(tmp_path / "small", random_documents(3, seed=3, max_len=4), shards=1)
    with pytest.raises(TorchpreError, match=r"small.*global batch needs 2"):
        build(folder, seq_len=64)
    with pytest.raises(TorchpreError, match=r"dataset_mixture.*small.*fewer than one sample"):
        build({str(folder): 1.0}, seq_len=64)


# ----- mixture order -------------------------------------------------------------------------------


def sources_of(order: MixtureOrder, positions: range) -> list[int]:
    return [bisect.bisect_right(order.offsets, order(p)) - 1 for p in positions]


def test_mixture_shares_match_the_weights():
    weights = [0.5, 0.3, 0.2]
    sources = [Source(f"s{i}", n, w) for i, (n, w) in enumerate(zip([100, 37, 1000], weights))]
    order = MixtureOrder(sources, seed=5)
    picked = sources_of(order, range(10_000))
    counts = np.bincount(picked, minlength=3)
    assert counts.tolist() == order.source_counts(10_000)
    for count, weight in zip(counts, weights):
        assert abs(count / 10_000 - weight) < 0.02
    # at every block end each source is within one sample of its exact share, however small its weight
    tiny = MixtureOrder([Source("big", 500, 0.999), Source("tiny", 50, 0.001)], seed=0)
    for end in range(BLOCK_SIZE, 50 * BLOCK_SIZE, 7 * BLOCK_SIZE):
        assert abs(tiny.source_counts(end)[1] - 0.001 * end) <= 1.5


def test_each_source_runs_through_its_own_epochs():
    order = MixtureOrder([Source("a", 37, 0.3), Source("b", 100, 0.7)], seed=1)
    positions = range(3 * BLOCK_SIZE)
    from_a = [order(p) for p, s in zip(positions, sources_of(order, positions)) if s == 0]
    assert sorted(from_a[:37]) == list(range(37)) and sorted(from_a[37:74]) == list(range(37))
    assert from_a[:37] != from_a[37:74]


def test_mixture_order_is_a_function_of_the_seed_and_position_only():
    """A fresh order computes any position without the history: what a resume relies on."""
    sources = [Source("a", 37, 2.0), Source("b", 100, 1.0), Source("c", 5, 1.0)]
    reference = [MixtureOrder(sources, seed=9)(p) for p in range(2500)]
    for p in [0, 1, 1023, 1024, 1025, 2047, 2499]:
        assert MixtureOrder(sources, seed=9)(p) == reference[p]
    assert [MixtureOrder(sources, seed=10)(p) for p in range(2500)] != reference


def test_a_mixture_of_order_version_1_is_the_one_checkpoints_saved_before_versions_were_trained_in():
    """Positions and counts computed by the mixture of main before issue 66 (recorded from it): a checkpoint that
    records no order version resumes in exactly this order."""
    sources = [Source("a", 37, 0.3), Source("b", 100, 0.6), Source("c", 11, 0.1)]
    order = MixtureOrder(sources, seed=9, version=1)
    positions = [0, 1, 2, 3, 500, 1023, 1024, 5000, 77777, 10**9]
    assert [order(p) for p in positions] == [134, 95, 60, 23, 75, 17, 3, 5, 66, 29]
    assert order.source_counts(77777) == [23327, 46673, 7777]


def test_positions_read_in_order_build_each_mixture_block_once_whatever_the_number_of_sources(monkeypatch):
    """The work per position does not grow with the sources: a position inside the block last used is O(1), and a
    block (about 1,024 positions) is built once, with vectorised passes over the 1,000 sources."""
    sources = [Source(f"s{i}", 50 + i, 1.0 + i % 7) for i in range(1000)]
    order = MixtureOrder(sources, seed=2)
    built = []
    make_block = order._make_block
    monkeypatch.setattr(order, "_make_block", lambda index: built.append(index) or make_block(index))
    picked = [order(p) for p in range(5 * BLOCK_SIZE)]
    assert built == list(range(1, len(built) + 1)) and len(built) <= 5  # each once; block 0 was built with the order
    assert np.bincount(sources_of(order, range(5 * BLOCK_SIZE)), minlength=1000).tolist() == order.source_counts(
        5 * BLOCK_SIZE
    )
    assert all(0 <= index < order.offsets[-1] for index in picked)


def mixture_sampler(local_batch_size: int, dp_rank: int, dp_size: int) -> GlobalBatchSampler:
    sources = [Source("a", 41, 0.6), Source("b", 300, 0.3), Source("c", 7, 0.1)]
    return GlobalBatchSampler(MixtureOrder(sources, seed=3), local_batch_size, dp_rank, dp_size)


def test_mixture_order_is_the_same_for_dp1_and_dp2_and_after_a_resume_at_any_step():
    steps, global_batch = 40, 64  # 2560 positions: more than two mixture blocks
    single = take(mixture_sampler(global_batch, 0, 1), steps)
    # dp2 with 2 accumulation microbatches of 16 per rank per step
    ranks = [take(mixture_sampler(16, r, 2), 2 * steps) for r in range(2)]
    for k in range(steps):
        assert [i for micro in (2 * k, 2 * k + 1) for r in range(2) for i in ranks[r][micro]] == single[k]
    for k in range(steps):
        resumed = mixture_sampler(32, 1, 2)
        resumed.load_state_dict({"consumed_samples": k * global_batch})
        assert next(resumed) == single[k][32:]


# ----- the loader ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mixture_folders(tmp_path_factory) -> dict[str, float]:
    root = tmp_path_factory.mktemp("mixture")
    web = write_shard_folder(root / "web", random_documents(300, seed=11))
    code = write_shard_folder(root / "code", random_documents(120, seed=12), shards=2)
    return {str(web): 0.7, str(code): 0.3}


@pytest.mark.parametrize("source", ["single", "mixture"])
def test_workers_yield_the_same_batches_and_resume_exactly(mixture_folders, source):
    data = next(iter(mixture_folders)) if source == "single" else mixture_folders
    reference = take(build(data, local_batch_size=4), 12)
    assert_same_batches(take(build(data, local_batch_size=4, num_workers=2), 12), reference)

    # the loader's own state after 5 batches, though its workers have prefetched beyond them
    loader = build(data, local_batch_size=4, num_workers=2)
    batches = iter(loader)
    take(batches, 5)
    state = loader.state_dict()
    resumed = build(data, local_batch_size=4, num_workers=2)
    resumed.load_state_dict(state)
    assert_same_batches(take(resumed, 7), reference[5:])

    # the trainer's way: the consumed position, restored before iterating, under another layout
    for k in (0, 3, 11):
        rank1 = build(data, local_batch_size=2, dp_rank=1, dp_size=2, num_workers=2)
        rank1.batch_sampler.load_state_dict({"consumed_samples": 4 * k})
        x, y = take(rank1, 1)[0]
        assert torch.equal(x, reference[k][0][2:]) and torch.equal(y, reference[k][1][2:])


def test_data_shares_report_the_mixture_realised_so_far(mixture_folders):
    loader = build(mixture_folders, local_batch_size=8)
    indices = [i for batch in take(build(mixture_folders, local_batch_size=8).batch_sampler, 200) for i in batch]
    code_samples = loader.dataset.cumulative_sizes[0]  # sources in path order: code, then web
    shares = data_shares(loader, len(indices))
    assert shares == {
        "data_share/code": sum(i < code_samples for i in indices) / len(indices),
        "data_share/web": sum(i >= code_samples for i in indices) / len(indices),
    }
    assert shares["data_share/web"] == pytest.approx(0.7, abs=0.01)
    assert data_shares(loader, 0) == {}
    assert data_shares(build(next(iter(mixture_folders))), 16) == {}


# ----- config keys ---------------------------------------------------------------------------------


def test_the_mixture_is_expressible_in_toml_and_on_the_command_line(tmp_path):
    config_file = tmp_path / "job.toml"
    config_file.write_text(
        textwrap.dedent(
            """
            [training]
            dataset = "shards"
            dataset_mixture = { "/data/web" = 0.7, "/data/code" = 3 }
            num_workers = 2
            """
        )
    )
    config = parse_args(JobConfig, ["--job.config_file", str(config_file)])
    assert config.training.dataset_mixture == {"/data/web": 0.7, "/data/code": 3.0}
    assert config.training.num_workers == 2
    cli = parse_args(JobConfig, ["--training.dataset_mixture", "/data/web=0.7,/data/code=0.3"])
    assert cli.training.dataset_mixture == {"/data/web": 0.7, "/data/code": 0.3}


@pytest.mark.parametrize(
    "training, message",
    [
        (lambda _: {"dataset": "shards"}, "exactly one of training.dataset_path"),
        (lambda _: {"dataset": "shards", "dataset_path": "no/dir"}, "training.dataset_path: the shard folder 'no/dir'"),
        (lambda _: {"dataset": "shards", "dataset_mixture": {"no/dir": 1.0}}, "dataset_mixture: the shard folder"),
        (lambda d: {"dataset": "shards", "dataset_mixture": {d: 0.0}}, r"dataset_mixture: the weight of '.*' is 0.0"),
        (lambda d: {"dataset": "shards", "dataset_mixture": {d: -1.0}}, "is -1.0; weights must be positive"),
        (lambda d: {"dataset": "shards", "dataset_mixture": {d: float("nan")}}, "is nan; weights must be positive"),
        (lambda d: {"dataset": "text", "dataset_path": d, "dataset_mixture": {d: 1.0}}, "set training.dataset = 's"),
        (lambda d: {"dataset": "stdlib", "dataset_path": d}, "training.dataset_path is set"),
        (lambda _: {"num_workers": -1}, "training.num_workers = -1"),
    ],
)
def test_bad_data_keys_name_the_key(tmp_path, training, message):
    config = JobConfig()
    for key, value in training(str(tmp_path)).items():
        setattr(config.training, key, value)
    with pytest.raises(ConfigError, match=message):
        validate_config(config)
