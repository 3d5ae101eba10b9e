"""A shard folder at the scale of a real run trains like a small one (issue 66).

train.py runs one step on a folder of many tiny shards and on a folder of 10, one after the other in this test, each
a fresh process limited to 1,024 descriptors (so that training at all proves the bound): the large folder's peak RSS
is within 10% and its time to the end of step 1 within 2x of the small one's. CI runs 10,000 shards; `-m data_scale`
runs 100,000. A folder of 1 trillion tokens (1,000 sparse shards of a billion each, read as token 0) runs a step
like one of 10 shards, under 2 GiB: nothing is kept per window (the sample order is `sampler.FeistelShuffle`)."""

import pytest

from bench.shard_folders import shard_folder, train_one_step

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("count", [10_000, pytest.param(100_000, marks=pytest.mark.data_scale)])
def test_a_folder_of_many_shards_trains_like_one_of_ten(count, tmp_path):
    many = shard_folder(tmp_path / "many", count)
    few = shard_folder(tmp_path / "few", 10)
    few_seconds, few_rss = train_one_step(few, tmp_path / "run_few")
    many_seconds, many_rss = train_one_step(many, tmp_path / "run_many")
    print(f"\n{count:,} shards: {many_seconds:.1f} s, {many_rss / 2**20:.0f} MiB; "
          f"10 shards: {few_seconds:.1f} s, {few_rss / 2**20:.0f} MiB")  # fmt: skip
    assert many_rss <= 1.10 * few_rss
    assert many_seconds <= 2 * few_seconds


def test_a_folder_of_a_trillion_tokens_starts_like_one_of_ten_shards_under_2_gib(tmp_path):
    """The time is compared with a 10-shard folder's in the same run (this machine may be busy); the absolute start-up
    time, 30 s at most, is `python -m bench.data_scale --only trillion`'s."""
    folder = shard_folder(tmp_path / "trillion", 1000, tokens_per_shard=10**9, sparse=True)
    few_seconds, _ = train_one_step(shard_folder(tmp_path / "few", 10), tmp_path / "run_few")
    seconds, rss = train_one_step(folder, tmp_path / "run")
    print(f"\n10^12 tokens ({10**12 // 33:,} windows of 33): {seconds:.1f} s, {rss / 2**20:.0f} MiB; "
          f"10 shards: {few_seconds:.1f} s")  # fmt: skip
    assert seconds <= 2 * few_seconds and rss < 2 * 2**30
