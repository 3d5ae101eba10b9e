"""train.py on pre-tokenized shards: loader workers with exact resume and a weighted mixture resharded
from dp2 to one process (bad shard input is in the catalogue, test_bad_input.py)."""

import json

import pytest

from tests.integration.test_checkpoint import losses, resume
from tests.launch import TINY, read_checkpoint, train_and_read_metrics
from tests.unit.test_shard_data import TOKENIZER, write_shard_folder

pytestmark = pytest.mark.slow

STEPS = ["--training.steps", "10", "--checkpoint.enable", "--checkpoint.interval", "5"]
SHARDS = ["--training.dataset", "shards"]


def documents(topic: str, count: int) -> list[list[int]]:
    texts = [f"{topic} document {i}: item {i % 13} goes with item {i * 7 % 13}, then {topic}." for i in range(count)]
    return TOKENIZER.encode_batch(texts, bos=True, eos=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("shards")
    return {
        "web": str(write_shard_folder(root / "web", documents("web", 400))),
        "code": str(write_shard_folder(root / "code", documents("code", 150), shards=2)),
    }


def test_workers_resume_exactly_and_change_nothing(folders, tmp_path):
    """With workers the sampler runs ahead of training by the prefetched batches; the checkpoint
    holds what training consumed, so the resumed run continues with the exact next batch."""
    args = [*TINY, *SHARDS, "--training.dataset_path", folders["web"], "--training.num_workers", "2", *STEPS]
    straight = train_and_read_metrics(args, 1, tmp_path / "run")
    in_process = train_and_read_metrics([*args, "--training.num_workers", "0"], 1, tmp_path / "no_workers")
    assert losses(in_process) == losses(straight)
    saved = read_checkpoint(tmp_path / "run" / "checkpoint" / "step-5")
    assert saved["dataloader"]["consumed_samples"] == 5 * 4  # not the sampler's count (it includes prefetched ones)
    resumed = resume(tmp_path / "run", args, 1, from_step=5)
    assert [r["step"] for r in resumed] == list(range(6, 11))
    assert losses(resumed) == losses(straight)[5:]


def test_mixture_from_toml_reshards_from_dp2_to_one_process(folders, tmp_path):
    config = tmp_path / "mixture.toml"
    table = ", ".join(f"{json.dumps(path)} = {weight}" for path, weight in ((folders["web"], 7), (folders["code"], 3)))
    config.write_text(f'[training]\ndataset = "shards"\ndataset_mixture = {{ {table} }}\nnum_workers = 2\n')
    common = ["--job.config_file", str(config), *TINY, *STEPS]
    straight = train_and_read_metrics([*common, "--training.local_batch_size", "2"], 2, tmp_path)
    resumed = resume(tmp_path, common, 1, from_step=5)  # TINY's local batch of 4: the same global batch
    assert [r["step"] for r in resumed] == list(range(6, 11))
    # dp2 -> 1 process changes only the reduction order of the loss and gradients
    assert losses(resumed) == pytest.approx(losses(straight)[5:], abs=1e-5)
    shares = [{k: v for k, v in r.items() if k.startswith("data_share/")} for r in straight]
    assert set(shares[-1]) == {"data_share/web", "data_share/code"}
    assert sum(shares[-1].values()) == pytest.approx(1) and min(shares[-1].values()) > 0
    assert [{k: v for k, v in r.items() if k.startswith("data_share/")} for r in resumed] == shares[5:]
