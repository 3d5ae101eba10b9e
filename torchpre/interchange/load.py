"""A Hugging Face folder's weights, loaded straight into a job's sharded model (`checkpoint.initial_load_path` = the
folder) or into whole tensors in one process (`python -m torchpre.convert hf-to-dcp`), through the same reader.

`hf_weights` checks the folder against the model before any work: its config.json against the job's model (every
field that differs named), and its tensors against where the family's adapter reads each of the model's
(`ModelSpec.hf.hf_sources`): missing, unknown and misshapen tensors named. `load_hf_weights` then loads any state
dict (whole tensors, DTensor shards, a pipeline stage's tensors) with DCP through `HFStorageReader`, each rank
reading the boxes it holds, and reports what that took: the bytes held and read, and the peak resident memory
while loading, against the bound 1.5 x held + 1 GiB (the process's own ~0.5 GiB of Python and torch, the boxes in
flight). Peak memory of a rank is then its shard, never a whole tensor it does not hold, let alone the model.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from torchpre.checkpoint.integrity import MANIFEST, SIGNING_KEY, Trust, read_manifest, verify_share
from torchpre.confined import file_kind
from torchpre.data.hf_tokenizer import TOKENIZER_CONFIG, TOKENIZER_JSON
from torchpre.errors import ConfigError, InputFileError, TorchpreError, UntrustedInput, resolve_step
from torchpre.interchange.reader import CONFIG, INDEX, HFFolder, read_config
from torchpre.interchange.storage import HFStorageReader, first_name
from torchpre.metrics.host_memory import peak_rss_bytes, reset_peak_rss, rss_bytes
from torchpre.models.args import ModelArgs
from torchpre.models.hf_sources import Sources, check_folder
from torchpre.models.registry import ModelSpec

logger = logging.getLogger("torchpre")

GIB = 2**30
FROM_HF = "from_hf"  # model.flavor: the model from checkpoint.initial_load_path's config.json


@dataclass(frozen=True)
class HFWeights:
    """A folder checked against a model: its tensors, where each of the model's comes from, and the model's shapes
    (its whole state dict's, by torchpre name)."""

    folder: HFFolder
    sources: Sources
    shapes: dict[str, torch.Size]

    def dtype(self, name: str) -> torch.dtype:
        """The dtype the folder gives the model's tensor `name` (bfloat16 for block-FP8 weights)."""
        return self.folder.dtype(first_name(self.sources.by_name[name]))


@dataclass(frozen=True)
class LoadReport:
    """One rank's load: the bytes of the tensors it holds and of those it read (as stored), its resident memory
    before and at its peak while loading, and the seconds it took."""

    held_bytes: int
    read_bytes: int
    rss_before: int
    peak_rss: int
    seconds: float

    @property
    def bound(self) -> int:
        return int(1.5 * self.held_bytes) + GIB

    def describe(self) -> str:
        return (
            f"held {_gib(self.held_bytes)}, read {_gib(self.read_bytes)}, peak RSS {_gib(self.peak_rss)} "
            f"({_gib(self.rss_before)} before; bound 1.5 x held + 1 GiB = {_gib(self.bound)})"
        )


def folder_args(path: Path, spec: ModelSpec, family: str) -> ModelArgs:
    """The family's args from the config.json of the folder at `path` (`model.flavor = "from_hf"`), every field read
    or refused (the adapter's `args_from_hf_config`)."""
    adapter = spec.hf
    if adapter is None or adapter.args_from_hf_config is None:
        raise ConfigError(
            f"model.flavor = '{FROM_HF}' with model.name = '{family}': this family cannot read its args from a Hugging "
            "Face config.json (llama3 and deepseek_v3 can; model.name = 'hf' takes any transformers config through "
            "model.hf_config). Choose one of the family's flavors."
        )
    config = read_config(path)  # its errors name the file
    try:
        return adapter.args_from_hf_config(config)
    except TorchpreError as error:
        raise InputFileError(f"model.flavor = '{FROM_HF}': {path / CONFIG}: {error}") from None


def model_shapes(spec: ModelSpec, args: ModelArgs) -> dict[str, torch.Size]:
    """The shape of every tensor in the model's state dict, from the model built on the meta device."""
    with torch.device("meta"):
        return {name: tensor.shape for name, tensor in spec.build.model_cls(args).state_dict().items()}


def check_hf_folder(path: Path, trust: Trust, allow_unsigned: bool, key: str) -> None:
    """Before any file of the folder is read (`key` names the setting that gave it): a folder with a manifest (a
    torchpre export) is checked against it as a checkpoint is, every file, and its signature under `trust`'s key;
    the files a load reads (config.json, the index, the safetensors, the tokenizer's) must be listed. A folder without
    one is an error under a key, unless `allow_unsigned` (checkpoint.allow_unsigned_hf: a model as released), which
    warns."""
    if file_kind(path, MANIFEST) == "missing":
        if trust.signing_key is None:
            return
        if not allow_unsigned:
            raise UntrustedInput(
                f"{key} = {path}: this Hugging Face folder has no {MANIFEST}, so it is not signed, and "
                f"{SIGNING_KEY} asks for folders signed with its key (a torchpre export under the key is). Set "
                "checkpoint.allow_unsigned_hf = true to load a model as released, unsigned (docs/security.md)."
            )
        logger.warning("%s = %s: loading an unsigned Hugging Face folder (checkpoint.allow_unsigned_hf = true)", key,
                       path)  # fmt: skip
        return
    problems = verify_share(path, 0, 1, Trust(signing_key=trust.signing_key))
    records = read_manifest(path) if not problems else {}
    read = [name for name in (CONFIG, INDEX, TOKENIZER_JSON, TOKENIZER_CONFIG) if file_kind(path, name) != "missing"]
    read += sorted(entry.name for entry in path.glob("*.safetensors"))
    problems += [f"{path / name} is not in its {MANIFEST}" for name in read if not problems and name not in records]
    if problems:
        raise TorchpreError(
            f"{key} = {path}: the Hugging Face folder does not match its {MANIFEST}: {'; '.join(problems)}. Restore "
            "the files, or export the folder again."
        )


@resolve_step
def hf_weights(path: Path, spec: ModelSpec, args: ModelArgs, key: str) -> HFWeights:
    """The folder at `path` (given as `key`, e.g. checkpoint.initial_load_path) checked against the model `args`
    describes: a TorchpreError names what does not fit and what to do, before any weight is read."""
    adapter = spec.hf
    parametrization = args.parametrization
    if not parametrization.is_standard:
        raise ConfigError(
            f"{key} = {path} is a Hugging Face folder, with model.parametrization = '{parametrization.name}': its "
            "weights are a model in the standard parametrization, without the µP multipliers, so they would not "
            "compute the model they were trained as. Train from scratch, or use model.parametrization = 'sp'."
        )
    if adapter is None or adapter.hf_sources is None:
        raise ConfigError(
            f"{key} = {path} is a Hugging Face folder, but this model family has no mapping from one (its ModelSpec's "
            "`hf` adapter has no hf_sources). Load it with model.name = 'hf' (transformers' own model), or convert it "
            "to a checkpoint another way."
        )
    config = read_config(path)
    try:
        mismatches = adapter.hf_config_mismatches(config, args)
    except TorchpreError as error:
        raise InputFileError(f"{key} = {path}: {path / CONFIG}: {error}") from None
    if mismatches:
        raise ConfigError(
            f"{key} = {path}: its config.json does not describe the job's model: {'; '.join(mismatches)}. Use the "
            "model the weights were made with (model.flavor = 'from_hf' reads it from the folder; with model.name = "
            "'hf', give the folder as model.hf_config)."
        )
    try:
        shapes = model_shapes(spec, args)
    except (TypeError, RuntimeError) as error:  # a size past int64 (TypeError), a tensor past 2**63 bytes
        raise InputFileError(
            f"{key} = {path}: {path / CONFIG} describes a model whose tensors no machine can hold "
            f"({str(error).splitlines()[0][:200]}). Use the model the weights were made with."
        ) from None
    folder = HFFolder(path)
    sources = adapter.hf_sources(args, folder.shapes.keys())
    try:
        check_folder(sources, shapes, folder.shapes)
    except TorchpreError as error:
        raise InputFileError(f"{key} = {path}: {error} Use the model the weights were made with.") from None
    return HFWeights(folder, sources, shapes)


def load_hf_weights(weights: HFWeights, targets: Mapping[str, Tensor], no_dist: bool = False) -> LoadReport:
    """Loads `targets` (this rank's tensors by torchpre name: whole, DTensors, a stage's) from the folder; a
    collective over the default process group unless `no_dist`. Tensors the folder reads as copies of one another
    check them box by box (`Copy`), so a bad folder still fails on every rank that reads it."""
    unknown = sorted(targets.keys() - weights.sources.by_name.keys())
    if unknown:
        raise TorchpreError(f"The model's {', '.join(unknown[:6])} have no source in {weights.folder.folder}.")
    reader = HFStorageReader(weights.folder, weights.sources.by_name, weights.shapes)
    rss_before, start, read_before = rss_bytes(), time.perf_counter(), weights.folder.bytes_read
    reset_peak_rss()
    try:
        dcp.load(dict(targets), storage_reader=reader, no_dist=no_dist)
    except CheckpointException as error:  # a bad folder found while reading, on any rank: its message on every rank
        raise _input_error(error, weights.folder.folder) or error from None
    held = sum(_local(tensor).numel() * _local(tensor).element_size() for tensor in targets.values())
    read = weights.folder.bytes_read - read_before
    return LoadReport(held, read, rss_before, peak_rss_bytes(), time.perf_counter() - start)


def log_reports(folder: Path, report: LoadReport) -> None:
    """Rank 0 logs every rank's load in one line (the rank nearest its memory bound first), and a warning for a rank
    that went past it."""
    reports = [report]
    if dist.is_initialized():
        reports = [None] * dist.get_world_size()
        dist.all_gather_object(reports, report)
        if dist.get_rank() != 0:
            return
    ranks = sorted(range(len(reports)), key=lambda r: -reports[r].peak_rss / reports[r].bound)
    seconds = max(r.seconds for r in reports)
    logger.info(
        "loaded the Hugging Face folder %s in %.1f s: %s",
        folder, seconds, "; ".join(f"rank {rank} {reports[rank].describe()}" for rank in ranks[:8]),
    )  # fmt: skip
    over = [rank for rank in ranks if reports[rank].peak_rss > reports[rank].bound]
    if over:
        logger.warning("ranks %s went past the loading memory bound 1.5 x held + 1 GiB", over)


def _input_error(error: CheckpointException, folder: Path) -> TorchpreError | None:
    """The first rank's TorchpreError among the failures DCP gathered, as the error of every rank, naming the folder
    (its message names the tensors)."""
    for rank, (failure, _) in sorted(error.failures.items()):
        if isinstance(failure, TorchpreError):
            named = str(failure) if str(folder) in str(failure) else f"{folder}: {failure}"
            return TorchpreError(f"{named} (found by rank {rank})")
    return None


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _gib(count: int) -> str:
    return f"{count / GIB:.3f} GiB"
