"""Data order, DP slicing, packing and exact resume of the loader."""

import json
import tracemalloc
from collections import Counter

import pytest
import torch

from torchpre.data.dataset import PackedWindows, pack_documents
from torchpre.data.documents import load_documents
from torchpre.data.loader import TrainingData, build_dataloader
from torchpre.data.sampler import ORDER_VERSION, ORDERS, EpochShuffle, FeistelShuffle, GlobalBatchSampler
from torchpre.data.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer
from torchpre.errors import TorchpreError
from torchpre.step_rules.batch import BatchSizes, CurrentBatch


def take(sampler: GlobalBatchSampler, n: int) -> list[list[int]]:
    return [next(sampler) for _ in range(n)]


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 1025])
def test_the_feistel_order_visits_each_sample_once_per_epoch_in_an_order_drawn_anew(n):
    order = FeistelShuffle(n, seed=11)
    epochs = [[order(p) for p in range(e * n, (e + 1) * n)] for e in range(3)]
    assert all(sorted(epoch) == list(range(n)) for epoch in epochs)
    if n >= 7:
        assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != list(range(n))
        assert epochs[0] != [FeistelShuffle(n, seed=12)(p) for p in range(n)]
    assert [FeistelShuffle(n, seed=11)(p) for p in range(2 * n, 3 * n)] == epochs[2]  # a function of the position


def test_the_feistel_order_draws_each_sample_about_equally_often_at_a_position():
    """Over 3,000 seeds, the sample at position 5 of 10: each of the 10 about 300 times (4 standard deviations)."""
    counts = Counter(FeistelShuffle(10, seed)(5) for seed in range(3000))
    assert sorted(counts) == list(range(10)) and all(abs(count - 300) <= 4 * 16.4 for count in counts.values())


def test_the_feistel_orders_memory_does_not_grow_with_the_sample_count():
    """An order of the 1.8 billion windows of 15T tokens at seq_len 8,192, and of a trillion, hold a few hundred
    bytes (version 1 holds 8 bytes a sample: 15 GB)."""
    for n in (1_800_000_000, 10**12):
        tracemalloc.start()
        order = FeistelShuffle(n, seed=0)
        picked = [order(p) for p in (0, 1, n - 1, n, 5 * n + 3)]
        size = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert size < 10_000 and all(0 <= index < n for index in picked)


@pytest.mark.parametrize("order", ORDERS.values(), ids=["v1", "v2"])
def test_sampler_order_is_a_function_of_the_seed(order):
    a = take(GlobalBatchSampler(order(50, 7), 4, 0, 1), 30)
    b = take(GlobalBatchSampler(order(50, 7), 4, 0, 1), 30)
    c = take(GlobalBatchSampler(order(50, 8), 4, 0, 1), 30)
    assert a == b
    assert a != c


@pytest.mark.parametrize("order", ORDERS.values(), ids=["v1", "v2"])
def test_sampler_visits_every_sample_once_per_epoch(order):
    batches = take(GlobalBatchSampler(order(40, 0), 5, 0, 1), 8)
    assert sorted(i for batch in batches for i in batch) == list(range(40))
    next_epoch = take(GlobalBatchSampler(order(40, 0), 5, 0, 1), 16)[8:]
    assert sorted(i for batch in next_epoch for i in batch) == list(range(40))
    assert next_epoch != batches


@pytest.mark.parametrize("order", ORDERS.values(), ids=["v1", "v2"])
@pytest.mark.parametrize("dp", [2, 4])
def test_dp_slices_concatenate_to_the_single_process_global_batch(dp, order):
    """Rank r's microbatch k is the r-th slice of round k: their union is the 1-process order."""
    single = take(GlobalBatchSampler(order(97, 3), 8, 0, 1), 12)
    per_rank = [take(GlobalBatchSampler(order(97, 3), 8 // dp, r, dp), 12) for r in range(dp)]
    for k in range(12):
        assert [i for r in range(dp) for i in per_rank[r][k]] == single[k]


@pytest.mark.parametrize("order", ORDERS.values(), ids=["v1", "v2"])
def test_sampler_state_resumes_under_another_dp_degree(order):
    reference = take(GlobalBatchSampler(order(60, 1), 4, 0, 1), 10)
    first = GlobalBatchSampler(order(60, 1), 2, 1, 2)
    take(first, 4)
    resumed = GlobalBatchSampler(order(60, 1), 4, 0, 1)
    resumed.load_state_dict(first.state_dict())
    assert take(resumed, 6) == reference[4:]


def test_sampler_rejects_a_position_inside_a_round():
    sampler = GlobalBatchSampler(EpochShuffle(60, 1), 4, 0, 2)
    with pytest.raises(ValueError, match="global sample 6"):
        sampler.load_state_dict({"consumed_samples": 6})


def test_packed_windows_are_shifted_next_token_pairs():
    windows = PackedWindows(torch.arange(23), seq_len=4)
    assert len(windows) == 4
    inputs, labels = windows[2]
    assert inputs.tolist() == [10, 11, 12, 13]
    assert labels.tolist() == [11, 12, 13, 14]


def test_pack_documents_wraps_each_document_in_bos_and_eos():
    tokenizer = load_tokenizer(DEFAULT_TOKENIZER_PATH)
    tokens = pack_documents(["hello world", "second"], tokenizer)
    first = tokenizer.encode("hello world", bos=True, eos=True)
    second = tokenizer.encode("second", bos=True, eos=True)
    assert tokens.tolist() == first + second
    assert first[0] == tokenizer.bos_id and first[-1] == tokenizer.eos_id


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))


def build(path, dp_rank=0, dp_size=1, local_batch_size=2, seq_len=8, order_version=ORDER_VERSION):
    return build_dataloader(
        dataset="text",
        dataset_path=str(path),
        tokenizer=load_tokenizer(DEFAULT_TOKENIZER_PATH),
        seq_len=seq_len,
        local_batch_size=local_batch_size,
        global_batch_size=local_batch_size * dp_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=0,
        vocab_size=load_tokenizer(DEFAULT_TOKENIZER_PATH).vocab_size,
        order_version=order_version,
    )


def test_loader_resumes_exactly_from_its_state_dict(tmp_path):
    data = tmp_path / "data.jsonl"
    write_jsonl(data, [f"document number {i} says something about topic {i % 7}." for i in range(200)])
    loader = build(data)
    batches = iter(loader)
    for _ in range(5):
        next(batches)
    state = loader.state_dict()
    expected = [next(batches) for _ in range(5)]

    resumed = build(data)
    resumed.load_state_dict(state)
    got = [b for _, b in zip(range(5), resumed)]
    for (x, y), (x2, y2) in zip(expected, got):
        assert torch.equal(x, x2) and torch.equal(y, y2)


def test_a_resumed_data_position_gives_the_batches_training_would_have_read(tmp_path):
    """The training data's checkpointed position counts the samples trained on (not the loader's prefetch), and a
    job that loads it reads the very batches the uninterrupted job reads next; one sample off shifts them all."""
    data = tmp_path / "data.jsonl"
    write_jsonl(data, [f"document number {i} says something about topic {i % 7}." for i in range(200)])
    running = TrainingData(build(data), CurrentBatch(BatchSizes(4, 2, 2, 8)))
    for _ in range(3):
        running.next_step()
        running.step_done()
    state = running.state_dict()
    assert state == {"consumed_samples": 12, "order_version": ORDER_VERSION}
    expected = running.next_step()

    resumed = TrainingData(build(data), CurrentBatch(BatchSizes(4, 2, 2, 8)))
    resumed.load_state_dict(state)
    got = resumed.next_step()
    assert resumed.consumed_samples == 12
    for (x, y), (x2, y2) in zip(expected, got, strict=True):
        assert torch.equal(x, x2) and torch.equal(y, y2)


def test_a_checkpoint_without_an_order_version_resumes_in_the_first_order_and_saves_it_on(tmp_path):
    """Checkpoints saved before the version was recorded were trained in version 1's order: they resume in it, at
    the exact next batch, and record it; a new run's batches are version 2's; an unknown version is refused."""
    data = tmp_path / "data.jsonl"
    write_jsonl(data, [f"document number {i} says something about topic {i % 7}." for i in range(200)])

    def loader_for(stage, version):
        return build(data, order_version=version)

    def steps(order_version: int, resumed_from: dict | None = None) -> TrainingData:
        batch = CurrentBatch(BatchSizes(4, 2, 2, 8))
        training = TrainingData(loader_for(0, order_version), batch, 0, loader_for, order_version)
        if resumed_from is not None:
            training.load_state_dict(resumed_from)
        return training

    old = steps(1)
    for _ in range(3):
        old.next_step()
        old.step_done()
    expected = old.next_step()
    resumed = steps(ORDER_VERSION)
    assert resumed.load_targets({"dataloader.consumed_samples"}) == {"consumed_samples": 0}
    assert "order_version" in resumed.load_targets({"dataloader.consumed_samples", "dataloader.order_version"})
    resumed.load_state_dict({"consumed_samples": 12})
    assert resumed.state_dict() == {"consumed_samples": 12, "order_version": 1}
    for (x, y), (x2, y2) in zip(expected, resumed.next_step(), strict=True):
        assert torch.equal(x, x2) and torch.equal(y, y2)
    new = steps(ORDER_VERSION, {"consumed_samples": 12, "order_version": ORDER_VERSION})
    assert isinstance(new.loader.batch_sampler.order, FeistelShuffle)
    assert not all(torch.equal(x, x2) for (x, _), (x2, _) in zip(expected, new.next_step()))
    with pytest.raises(ValueError, match=r"order_version is 3; this torchpre knows the sample orders \[1, 2\]"):
        steps(ORDER_VERSION, {"consumed_samples": 12, "order_version": 3})


def test_loader_dp_ranks_split_the_global_batch(tmp_path):
    data = tmp_path / "data.jsonl"
    write_jsonl(data, [f"line {i} with a few more words in it" for i in range(300)])
    single = [b for _, b in zip(range(3), build(data, local_batch_size=4))]
    ranks = [[b for _, b in zip(range(3), build(data, r, 2, local_batch_size=2))] for r in range(2)]
    for k in range(3):
        assert torch.equal(torch.cat([ranks[0][k][0], ranks[1][k][0]]), single[k][0])


def test_loader_too_small_dataset_names_the_file_and_the_fix(tmp_path):
    data = tmp_path / "small.jsonl"
    write_jsonl(data, ["tiny"])
    with pytest.raises(TorchpreError, match=r"small\.jsonl.*training\.seq_len"):
        build(data)


def test_documents_errors_name_the_path(tmp_path):
    with pytest.raises(TorchpreError, match="does not exist"):
        load_documents("text", str(tmp_path / "missing.txt"))
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(TorchpreError, match="holds no text"):
        load_documents("text", str(empty))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"content": "x"}\n')
    with pytest.raises(TorchpreError, match=r"bad\.jsonl:1.*'text'"):
        load_documents("text", str(bad))
    (tmp_path / "notes.csv").write_text("a,b")
    with pytest.raises(TorchpreError, match="supported"):
        load_documents("text", str(tmp_path / "notes.csv"))


def test_documents_from_a_folder_in_name_order(tmp_path):
    (tmp_path / "b.txt").write_text("second")
    write_jsonl(tmp_path / "a.jsonl", ["first", "also first"])
    assert load_documents("text", str(tmp_path)) == ["first", "also first", "second"]
