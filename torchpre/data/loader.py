"""Builds the resumable data loader of one data-parallel rank."""

import warnings

from torchdata.stateful_dataloader import StatefulDataLoader

from torchpre.data.dataset import PackedWindows, pack_documents
from torchpre.data.documents import load_documents
from torchpre.data.sampler import GlobalBatchSampler
from torchpre.data.tokenizer import Tokenizer
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
) -> StatefulDataLoader:
    """Tokenizes and packs the dataset and returns a loader of (inputs, labels) microbatches.

    Its `state_dict()` holds the global sample position, so a run resumes at the exact next batch.
    """
    tokens = pack_documents(load_documents(dataset, dataset_path), tokenizer)
    windows = PackedWindows(tokens, seq_len)
    if len(windows) < global_batch_size:
        source = dataset_path or dataset
        raise TorchpreError(
            f"The dataset '{source}' has {tokens.numel():,} tokens, enough for {len(windows)} samples of "
            f"training.seq_len + 1 = {seq_len + 1} tokens, but one global batch needs {global_batch_size}. "
            "Use more text, or lower training.seq_len or training.global_batch_size."
        )
    sampler = GlobalBatchSampler(len(windows), local_batch_size, dp_rank, dp_size, seed)
    return StatefulDataLoader(windows, batch_sampler=sampler, num_workers=0)
