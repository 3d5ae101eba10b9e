"""Builds the resumable data loader of one data-parallel rank."""

import warnings
from pathlib import Path

from torch.utils.data import ConcatDataset, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from torchpre.data.dataset import PackedWindows, pack_documents
from torchpre.data.documents import load_documents
from torchpre.data.mixture import MixtureOrder, Source
from torchpre.data.sampler import EpochShuffle, GlobalBatchSampler, SampleOrder
from torchpre.data.shard_dataset import ShardWindows
from torchpre.data.tokenizer import Tokenizer, tokenizer_hash
from torchpre.errors import TorchpreError

# torchdata 0.11 calls a torch API that newer torch deprecated; the warning says nothing to users.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")


def build_dataloader(
    *,
    dataset: str,
    dataset_path: str,
    tokenizer: Tokenizer,
    seq_len: int,
    local_batch_size: int,
    global_batch_size: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    dataset_mixture: dict[str, float] | None = None,
    num_workers: int = 0,
) -> StatefulDataLoader:
    """Returns a loader of (inputs, labels) microbatches of `training.dataset`.

    The order is fixed by the seed over global sample positions; workers (`num_workers` > 0) only
    read the samples the main process's sampler picks, so they never change the batches. The
    loader's `state_dict()`, and its sampler's `consumed_samples`, hold the global position, so a run
    resumes at the exact next batch (with workers the sampler runs ahead of what was consumed: a
    trainer restores the position it consumed with `batch_sampler.load_state_dict`).
    """
    if dataset == "shards" and dataset_mixture:
        samples, order = _mixture(dataset_mixture, seq_len, tokenizer, seed)
    else:
        samples, order = _single_source(dataset, dataset_path, seq_len, tokenizer, global_batch_size, seed)
    sampler = GlobalBatchSampler(order, local_batch_size, dp_rank, dp_size)
    return StatefulDataLoader(samples, batch_sampler=sampler, num_workers=num_workers)


def data_shares(loader: StatefulDataLoader, consumed_samples: int) -> dict[str, float]:
    """`data_share/NAME`: the fraction of the tokens trained on so far (the first `consumed_samples`
    global positions) that came from each source of a mixture; empty for a single source.

    Every sample has seq_len + 1 tokens, so token shares equal sample shares, and they are computed
    from the order, so they are the same for every layout and across resumes.
    """
    order = loader.batch_sampler.order
    if not isinstance(order, MixtureOrder) or consumed_samples == 0:
        return {}
    counts = order.source_counts(consumed_samples)
    return {f"data_share/{source.name}": count / consumed_samples for source, count in zip(order.sources, counts)}


def _single_source(
    dataset: str, dataset_path: str, seq_len: int, tokenizer: Tokenizer, global_batch_size: int, seed: int
) -> tuple[Dataset, SampleOrder]:
    if dataset == "shards":
        samples = ShardWindows(dataset_path, seq_len, tokenizer_hash(tokenizer.path))
        num_tokens = samples.num_tokens
    else:
        tokens = pack_documents(load_documents(dataset, dataset_path), tokenizer)
        samples, num_tokens = PackedWindows(tokens, seq_len), tokens.numel()
    if len(samples) < global_batch_size:
        raise TorchpreError(
            f"The dataset '{dataset_path or dataset}' has {num_tokens:,} tokens, enough for {len(samples)} samples "
            f"of training.seq_len + 1 = {seq_len + 1} tokens, but one global batch needs {global_batch_size}. "
            "Use more text, or lower training.seq_len or training.global_batch_size."
        )
    return samples, EpochShuffle(len(samples), seed)


def _mixture(weights: dict[str, float], seq_len: int, tokenizer: Tokenizer, seed: int) -> tuple[Dataset, MixtureOrder]:
    """The sources in path order (so reordering the table changes nothing), concatenated; the
    mixture order picks from them."""
    folders = sorted(weights)
    names = _source_names(folders)
    sha256 = tokenizer_hash(tokenizer.path)
    windows = [ShardWindows(folder, seq_len, sha256) for folder in folders]
    for folder, source in zip(folders, windows):
        if len(source) == 0:
            raise TorchpreError(
                f"training.dataset_mixture: the shard folder {folder} has {source.num_tokens:,} tokens, fewer than "
                f"one sample of training.seq_len + 1 = {seq_len + 1}. Remove it or give it more data."
            )
    sources = [Source(name, len(w), weights[folder]) for name, w, folder in zip(names, windows, folders)]
    return ConcatDataset(windows), MixtureOrder(sources, seed)


def _source_names(folders: list[str]) -> list[str]:
    """Each folder's last path component, or the whole path where those are not unique."""
    short = [Path(folder).name for folder in folders]
    unique = all(short) and len(set(short)) == len(short)
    return short if unique else folders
