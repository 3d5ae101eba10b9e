"""Builds the resumable data loader of one data-parallel rank."""

import math
import warnings
from collections.abc import Callable, Hashable
from pathlib import Path

import torch
from torch.utils.data import ConcatDataset, Dataset, Subset
from torchdata.stateful_dataloader import StatefulDataLoader

from torchpre.data.dataset import PackedWindows, pack_documents
from torchpre.data.documents import load_documents
from torchpre.data.mixture import MixtureOrder, Source
from torchpre.data.sampler import ORDER_VERSION, ORDERS, GlobalBatchSampler, SampleOrder, shuffle
from torchpre.data.shard_dataset import ShardWindows
from torchpre.data.synthetic import SyntheticTokens, in_order
from torchpre.data.tokenizer import Tokenizer
from torchpre.errors import ConfigError, TorchpreError
from torchpre.step_rules.batch import CurrentBatch

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
    held_out_fraction: float = 0.0,
    vocab_size: int,
    pin_memory: bool = False,
    order_version: int = ORDER_VERSION,
) -> StatefulDataLoader:
    """Returns a loader of (inputs, labels) microbatches of `training.dataset`.

    The order is fixed by the seed over global sample positions; workers (`num_workers` > 0) only
    read the samples the main process's sampler picks, so they never change the batches. The
    loader's `state_dict()`, and its sampler's `consumed_samples`, hold the global position, so a run
    resumes at the exact next batch (with workers the sampler runs ahead of what was consumed: a
    trainer restores the position it consumed with `batch_sampler.load_state_dict`).

    `held_out_fraction` > 0 sets aside the last windows of every source for validation (see
    `split_held_out` and `held_out_samples`) and the order runs over the rest only; 0 leaves the
    samples and their order exactly as they are.

    `vocab_size` is the number of rows of the model's embedding: `dataset = "synthetic"` draws tokens in [0,
    `vocab_size`) (see `SyntheticTokens`; the tokenizer is not used), and every shard window is checked against it.
    `pin_memory` (see `pins_memory`) puts each batch in page-locked memory, so that its copy to the GPU can run
    asynchronously (`non_blocking=True`). `order_version` picks the sample order (`sampler.ORDERS`): a resume
    passes the one its checkpoint records.
    """
    if dataset == "synthetic":
        samples, order = SyntheticTokens(seq_len, vocab_size, seed), in_order
    elif dataset == "shards" and dataset_mixture:
        samples, order = _mixture(
            dataset_mixture, seq_len, tokenizer, vocab_size, seed, held_out_fraction, held_out=False,
            version=order_version,
        )  # fmt: skip
    else:
        samples = _single_source(
            dataset, dataset_path, seq_len, tokenizer, vocab_size, global_batch_size, held_out_fraction
        )
        order = shuffle(len(samples), seed, order_version)
    sampler = GlobalBatchSampler(order, local_batch_size, dp_rank, dp_size)
    # A generator of its own: each iterator draws its workers' base seed from it, never from the global generator,
    # whose state a checkpoint saves (a resume's first iterator would otherwise move it).
    return StatefulDataLoader(
        samples, batch_sampler=sampler, num_workers=num_workers, pin_memory=pin_memory, generator=torch.Generator()
    )


Batch = tuple[torch.Tensor, torch.Tensor]


class TrainingData:
    """This rank's training batches, and the job's data position: the global samples the steps so far trained on
    (`consumed_samples`), which a checkpoint saves (`state_dict`) and a resume, under any layout, continues from.

    Not the sampler's own counter, which runs ahead of training by the batches that loader workers prefetch: the
    loop says when a step is done (`step_done`), and a resume puts the sampler where training stopped.

    `loader` reads data stage `stage` (any hashable key) in the sample order `order_version` (`sampler.ORDERS`);
    `loader_for(stage, order_version)` builds another stage's, or another order's: `enter(stage)` switches to a stage
    at the current position, and a checkpoint saved with another order resumes in it. Each step's microbatches and
    samples are the `batch`'s now (a global-batch ramp changes them)."""

    def __init__(
        self,
        loader: StatefulDataLoader,
        batch: CurrentBatch,
        stage: Hashable = None,
        loader_for: Callable[[Hashable, int], StatefulDataLoader] | None = None,
        order_version: int = ORDER_VERSION,
    ):
        self.loader, self.stage, self.loader_for = loader, stage, loader_for
        self.batch = batch
        self.order_version = order_version
        self.consumed_samples = 0
        self.stage_first_sample = 0  # where the stage's data began: `shares` counts from there
        self._batches = None

    def enter(self, stage: Hashable, first_sample: int) -> None:
        """Trains on `stage`'s data from the current position on (its loader continues that stage's order at
        `consumed_samples`); `first_sample` is the global sample its data began at."""
        self.stage_first_sample = first_sample
        if stage == self.stage:
            return
        self.stage, self.loader, self._batches = stage, self.loader_for(stage, self.order_version), None
        self.loader.batch_sampler.load_state_dict({"consumed_samples": self.consumed_samples})

    def next_step(self) -> list[Batch]:
        """This rank's microbatches of the next optimizer step (`accumulation_steps` of them)."""
        if self._batches is None:  # from the position a resume (or a stage change) set
            self._batches = iter(self.loader)
        return [next(self._batches) for _ in range(self.batch.sizes.accumulation_steps)]

    def step_done(self) -> None:
        self.consumed_samples += self.batch.sizes.global_batch_size

    def shares(self) -> dict[str, float]:
        """`data_share/NAME` of the tokens trained on so far in this stage (see `data_shares`)."""
        return data_shares(self.loader, self.consumed_samples, self.stage_first_sample)

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples, "order_version": self.order_version}

    def load_targets(self, saved: set[str]) -> dict[str, int]:
        """What a checkpoint with the flattened keys `saved` gives this state: the order's version only where it
        records one (a checkpoint saved before versions were recorded was trained in version 1's order)."""
        state = self.state_dict()
        if "dataloader.order_version" not in saved:
            del state["order_version"]
        return state

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Resumes the data order at the saved global sample, in the order the checkpoint was trained in (before the
        loader is first iterated)."""
        version = int(state_dict.get("order_version", 1))
        if version not in ORDERS:
            raise ValueError(f"order_version is {version}; this torchpre knows the sample orders {sorted(ORDERS)}")
        if version != self.order_version:
            self.order_version, self.loader = version, self.loader_for(self.stage, version)
        self.consumed_samples = int(state_dict["consumed_samples"])
        self.loader.batch_sampler.load_state_dict({"consumed_samples": self.consumed_samples})
        self._batches = None


def pins_memory(device: torch.device) -> bool:
    """Whether batches bound for `device` are pinned: on CUDA only, where a copy from pinned memory runs
    asynchronously (CPU training has no copy to overlap, and pinning needs a CUDA driver)."""
    return device.type == "cuda"


def data_shares(loader: StatefulDataLoader, consumed_samples: int, first_sample: int = 0) -> dict[str, float]:
    """`data_share/NAME`: the fraction of the tokens trained on in the global positions [first_sample,
    consumed_samples) (a data stage's, or the whole run's) that came from each source of a mixture; empty for a
    single source.

    Every sample has seq_len + 1 tokens, so token shares equal sample shares, and they are computed
    from the order, so they are the same for every layout and across resumes.
    """
    order = loader.batch_sampler.order
    trained = consumed_samples - first_sample
    if not isinstance(order, MixtureOrder) or trained <= 0:
        return {}
    before = order.source_counts(first_sample)
    counts = [end - start for end, start in zip(order.source_counts(consumed_samples), before)]
    return {f"data_share/{source.name}": count / trained for source, count in zip(order.sources, counts)}


def held_out_samples(
    *,
    dataset: str,
    dataset_path: str,
    tokenizer: Tokenizer,
    seq_len: int,
    seed: int,
    fraction: float,
    vocab_size: int,
    dataset_mixture: dict[str, float] | None = None,
) -> tuple[Dataset, SampleOrder]:
    """The windows that `build_dataloader(..., held_out_fraction=fraction)` leaves out of training, in a
    seeded order; for a mixture, each source's held-out windows drawn with the training weights."""
    if dataset == "shards" and dataset_mixture:
        return _mixture(dataset_mixture, seq_len, tokenizer, vocab_size, seed, fraction, held_out=True)
    samples = split_held_out(_windows(dataset, dataset_path, seq_len, tokenizer, vocab_size)[0], fraction)[1]
    return samples, shuffle(len(samples), seed)


def source_samples(
    *, dataset: str, dataset_path: str, tokenizer: Tokenizer, seq_len: int, seed: int, vocab_size: int
) -> tuple[Dataset, SampleOrder]:
    """Every window of one source, in a seeded order: a validation set of its own."""
    samples = _windows(dataset, dataset_path, seq_len, tokenizer, vocab_size)[0]
    return samples, shuffle(len(samples), seed)


def split_held_out(windows: Dataset, fraction: float) -> tuple[Dataset, Dataset]:
    """(training part, held-out part) of one source: the held-out part is its last ceil(fraction x n)
    windows, the training part the rest (all of it, untouched, for fraction 0).

    A contiguous tail rather than a random subset: windows are cut from documents packed back to back,
    so a random subset would share most of its documents with the training windows around it, while
    the tail shares only the one document that straddles the cut.
    """
    if fraction == 0:
        return windows, Subset(windows, range(0))
    cut = len(windows) - math.ceil(fraction * len(windows))
    return Subset(windows, range(cut)), Subset(windows, range(cut, len(windows)))


def _windows(
    dataset: str, dataset_path: str, seq_len: int, tokenizer: Tokenizer, vocab_size: int
) -> tuple[Dataset, int]:
    """The seq_len+1-token windows of one source, and its token count (for messages); shard windows checked against
    the model's `vocab_size` rows."""
    if dataset == "shards":
        samples = ShardWindows(dataset_path, seq_len, tokenizer.sha256, vocab_size)
        return samples, samples.num_tokens
    tokens = pack_documents(load_documents(dataset, dataset_path), tokenizer)
    return PackedWindows(tokens, seq_len), tokens.numel()


def _single_source(
    dataset: str,
    dataset_path: str,
    seq_len: int,
    tokenizer: Tokenizer,
    vocab_size: int,
    global_batch_size: int,
    held_out_fraction: float,
) -> Dataset:
    """The training windows of one source: all but its held-out tail, at least a global batch of them."""
    windows, num_tokens = _windows(dataset, dataset_path, seq_len, tokenizer, vocab_size)
    samples = split_held_out(windows, held_out_fraction)[0]
    if len(samples) < global_batch_size <= len(windows):
        raise ConfigError(
            f"validation.split_fraction = {held_out_fraction} holds out {len(windows) - len(samples)} of the "
            f"{len(windows)} samples of '{dataset_path or dataset}', leaving {len(samples)} for training, fewer "
            f"than one global batch ({global_batch_size}). Lower validation.split_fraction or give validation "
            "data of its own (validation.dataset)."
        )
    if len(samples) < global_batch_size:
        raise TorchpreError(
            f"The dataset '{dataset_path or dataset}' has {num_tokens:,} tokens, enough for {len(samples)} samples "
            f"of training.seq_len + 1 = {seq_len + 1} tokens, but one global batch needs {global_batch_size}. "
            "Use more text, or lower training.seq_len or training.global_batch_size."
        )
    return samples


def _mixture(
    weights: dict[str, float],
    seq_len: int,
    tokenizer: Tokenizer,
    vocab_size: int,
    seed: int,
    held_out_fraction: float,
    held_out: bool,
    version: int = ORDER_VERSION,
) -> tuple[Dataset, MixtureOrder]:
    """The sources in path order (so reordering the table changes nothing), concatenated; the
    mixture order picks from them. With `held_out_fraction` > 0 each source is first cut by
    `split_held_out`, and its training part (or, with `held_out`, its held-out part) is used."""
    folders = sorted(weights)
    names = _source_names(folders)
    windows = [ShardWindows(folder, seq_len, tokenizer.sha256, vocab_size) for folder in folders]
    for folder, source in zip(folders, windows):
        if len(source) == 0:
            raise TorchpreError(
                f"training.dataset_mixture: the shard folder {folder} has {source.num_tokens:,} tokens, fewer than "
                f"one sample of training.seq_len + 1 = {seq_len + 1}. Remove it or give it more data."
            )
    parts = [split_held_out(source, held_out_fraction)[1 if held_out else 0] for source in windows]
    for folder, source, part in zip(folders, windows, parts):
        if len(part) == 0:
            raise ConfigError(
                f"validation.split_fraction = {held_out_fraction} holds out all {len(source)} samples of the shard "
                f"folder {folder}, leaving none for training. Lower validation.split_fraction, give the folder more "
                "data, or give validation data of its own (validation.dataset)."
            )
    sources = [Source(name, len(part), weights[folder]) for name, part, folder in zip(names, parts, folders)]
    return ConcatDataset(parts), MixtureOrder(sources, seed, version)


def _source_names(folders: list[str]) -> list[str]:
    """Each folder's last path component, or the whole path where those are not unique."""
    short = [Path(folder).name for folder in folders]
    unique = all(short) and len(set(short)) == len(short)
    return short if unique else folders
