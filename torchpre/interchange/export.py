"""Hugging Face exports during training: every hf_export.interval steps (and at the last step) a folder
`{hf_export.folder}/step-N/` that `transformers.AutoModelForCausalLM.from_pretrained` loads (config.json,
generation_config.json, safetensors weights, the tokenizer), written from any layout.

No rank gathers the model. Each tensor of the model's state dict (the checkpoint's "model" entry) has one owner among
the ranks that hold it (its pipeline stage's data- and tensor-parallel ranks), chosen once to balance their bytes; a
sharded tensor is gathered whole (`DTensor.full_tensor`, one tensor at a time) and kept by its owner only. Each
owner maps its tensors to Hugging Face names and layouts with the family's own adapter (`ModelSpec.hf`, the
mapping `python -m torchpre.convert dcp-to-hf` uses), the tensors it does not own standing in as meta tensors,
and writes them as its own safetensors file; rank 0 adds the index (`model.safetensors.index.json`, when several
ranks write), the config and the tokenizer.

The gather and the copy to the host happen between steps; with hf_export.async_mode = "async" the files are
written and the folder published by a thread while training goes on, on a gloo group of the exporter's own. A
folder lives as a checkpoint does (`torchpre.checkpoint.published`): written as `.tmp-step-N` and renamed to `step-N`
by rank 0 once every rank's file is written, so a `step-N` folder is always complete. Rank 0 creates the `.tmp-step-N`
folder (a new one: never one already there, nor a symbolic link) and marks it as torchpre's before any rank writes into
it (the published folder loses it: it holds Hugging Face's files only); a restarted job, and a failed export, remove
only `.tmp-` folders that hold that marker, and only the newest hf_export.keep_latest_k are kept. An export that fails
raises on every rank at the next export or at the end of training.
"""

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchpre.checkpoint.integrity import all_gather
from torchpre.checkpoint.published import Finisher, StepFolders, background_group
from torchpre.config.job_config import HFExport
from torchpre.data.tokenizer import Tokenizer
from torchpre.errors import StorageError, UntrustedInput
from torchpre.interchange.folder import (
    SAFETENSORS,
    give_default_modes,
    save_safetensors,
    shard_file_name,
    sign_folder,
    write_index,
    write_metadata,
)
from torchpre.models.args import ModelArgs
from torchpre.models.registry import ModelSpec
from torchpre.parallel.api import ParallelModel

logger = logging.getLogger("torchpre")


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype
    holders: tuple[int, ...]  # the global ranks whose state dict has it


class HFExporter:
    """Writes one job's Hugging Face exports into `folder` as `settings` ([hf_export]) says; `export` is collective.
    `max_length` is the context written to the config (`model_context`); with `signing_key` (the job's
    checkpoint.signing_key_file) each export is signed."""

    def __init__(
        self,
        folder: Path,
        settings: HFExport,
        model: ParallelModel,
        spec: ModelSpec,
        args: ModelArgs,
        tokenizer: Tokenizer,
        max_length: int,
        signing_key: bytes | None = None,
    ):
        self.folder, self.settings, self.model = folder, settings, model
        self.signing_key = signing_key
        self.adapter, self.args, self.tokenizer, self.max_length = spec.hf, args, tokenizer, max_length
        self.rank = dist.get_rank()
        tied = spec.build.tied_weights(args)
        self.skipped = {tied[1]} if tied else set()  # the output copy of a tied embedding: Hugging Face omits it
        self.tensors = _tensor_infos(self._local_state())
        self.owners = _balanced_owners(self.tensors)
        self.dtype = getattr(torch, settings.dtype) if settings.dtype else next(iter(self.tensors.values())).dtype
        # Tensors the adapter makes from nothing (e.g. a zero router bias): rank 0 writes them.
        made = self.adapter.to_hf_state_dict(self._stand_ins({}), args)
        self.constants = {name for name, tensor in made.items() if not tensor.is_meta}
        writers = sorted(set(self.owners.values()) | {0})
        self.file_name = (
            SAFETENSORS if len(writers) == 1 else shard_file_name(writers.index(self.rank) + 1, len(writers))
        ) if self.rank in writers else None  # fmt: skip
        self.several_files = len(writers) > 1
        self.steps = StepFolders(folder, "hf_export.folder", "Hugging Face export", settings.keep_latest_k,
                                 keeps_marker=False)  # fmt: skip
        background = settings.async_mode == "async"
        self.group = background_group() if background else None
        self._finisher = Finisher(background)

    def due(self, step: int, last_step: int) -> bool:
        return step % self.settings.interval == 0 or step == last_step

    def remove_unfinished(self) -> None:
        """Rank 0 deletes the temporary folders of exports that did not finish (a crashed run's), and only those:
        `.tmp-` folders that hold torchpre's marker, as checkpoints' (`StepFolders.remove_unfinished`)."""
        if self.rank == 0:
            self.steps.remove_unfinished()

    def export(self, step: int) -> None:
        """Gathers this rank's tensors to the host, then writes and publishes step-N (in the background under
        async_mode)."""
        self.wait()
        start = time.perf_counter()
        weights = self._hf_tensors(self._gather())
        tmp = self.steps.temporary(step)
        box = [self._create(step) if self.rank == 0 else None]
        dist.broadcast_object_list(box, group_src=0)
        if box[0] is not None:
            raise box[0]
        if self.rank == 0 and self.group is not None:
            logger.info("Hugging Face export of step %d on the host in %.2f s; writing in the background", step,
                        time.perf_counter() - start)  # fmt: skip
        self._finisher.finish(self._write_and_publish, step, tmp, weights, start)

    def _create(self, step: int) -> StorageError | UntrustedInput | None:
        """Rank 0 makes step's `.tmp-step-N`, a new folder marked as torchpre's; the error every rank raises if it
        cannot."""
        try:
            self.steps.create(step)
        except UntrustedInput as error:
            return error
        except OSError as error:  # checked writable at start-up: the file system changed since
            return StorageError(f"hf_export.folder: cannot create {self.steps.temporary(step)} for step {step}'s "
                                f"export: {error}")  # fmt: skip
        return None

    def wait(self) -> None:
        """Until the background export, if one is running, is published; raises its failure."""
        self._finisher.wait()

    def close(self) -> None:
        self._finisher.close()

    def _local_state(self) -> dict[str, torch.Tensor]:
        """This rank's part of the model's state dict (by full-model names), without the tied copy."""
        state: dict[str, torch.Tensor] = {}
        for part in self.model.parts:
            state.update(part.state_dict())
        return {name: tensor for name, tensor in state.items() if name not in self.skipped}

    def _gather(self) -> dict[str, torch.Tensor]:
        """The whole tensors this rank owns, on the host; sharded ones gathered one at a time, in the same order on
        every rank that holds them."""
        owned = {}
        for name, tensor in sorted(self._local_state().items()):
            whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            if self.owners[name] == self.rank:
                owned[name] = torch.empty(whole.shape, dtype=whole.dtype, device="cpu").copy_(whole.detach())
        return owned

    def _stand_ins(self, owned: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The whole state dict for the adapter: the owned tensors, meta tensors of the right shape for the rest."""
        return {
            name: owned[name] if name in owned else torch.empty(info.shape, dtype=info.dtype, device="meta")
            for name, info in self.tensors.items()
        }

    def _hf_tensors(self, owned: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's tensors under their Hugging Face names and layouts, in the export dtype."""
        hf = self.adapter.to_hf_state_dict(self._stand_ins(owned), self.args)
        return {
            name: tensor.to(self.dtype).contiguous()
            for name, tensor in hf.items()
            if not tensor.is_meta and (name not in self.constants or self.rank == 0)
        }

    def _write_and_publish(
        self, step: int, tmp: Path, weights: dict[str, torch.Tensor], start: float
    ) -> BaseException | None:
        """Writes this rank's file (rank 0 also the config and tokenizer); once every rank has, rank 0 writes the
        index and renames the folder, or removes it if any rank failed. Returns the error to raise on every rank (one
        message with each rank's failure), if any."""
        error = None
        try:
            if weights:
                save_safetensors(weights, tmp / self.file_name)
            if self.rank == 0:
                dtype = str(self.dtype).removeprefix("torch.")
                write_metadata(tmp, self.adapter, self.args, self.tokenizer, self.max_length, dtype)
        except Exception as failure:
            error = failure
        written = {name: t.numel() * t.element_size() for name, t in weights.items()}
        parts = all_gather((self.file_name, written, None if error is None else f"{type(error).__name__}: {error}"),
                           self.group)  # fmt: skip
        failures = {rank: failure for rank, (_, _, failure) in enumerate(parts) if failure is not None}
        outcome = None
        if self.rank == 0:
            outcome = self._publish_or_remove(step, tmp, parts, failures, start)
        box = [outcome]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return None if box[0] is None else StorageError(box[0])

    def _publish_or_remove(
        self, step: int, tmp: Path, parts: list[tuple[str | None, dict[str, int], str | None]],
        failures: dict[int, str], start: float,
    ) -> str | None:  # fmt: skip
        """Rank 0's part: the index and the rename that makes the export visible, then retention; or the folder
        removed and a message saying what failed."""
        final = self.steps.final(step)

        def finalize(folder: Path) -> None:
            if self.several_files:
                weight_map = {name: file for file, sizes, _ in parts for name in sizes}
                write_index(folder, weight_map, sum(sum(sizes.values()) for _, sizes, _ in parts))
            give_default_modes(folder)
            if self.signing_key is not None:
                sign_folder(folder, self.signing_key)

        error = self.steps.publish_or_discard(tmp, step, finalize, failed=bool(failures))
        if error is not None:
            failures = {0: f"{type(error).__name__}: {error}"}
        if failures:
            lines = "; ".join(f"rank {rank}: {failure}" for rank, failure in sorted(failures.items()))
            return f"The Hugging Face export of step {step} to {final} failed ({lines}); nothing was published."
        logger.info("Hugging Face export %s published %.2f s after it started", final, time.perf_counter() - start)
        self.steps.keep_newest()
        return None


def _tensor_infos(local: dict[str, torch.Tensor]) -> dict[str, TensorInfo]:
    """Every tensor of the model by name (whole shapes), with the ranks holding it: gathered from every rank."""
    mine = {name: (tuple(tensor.shape), tensor.dtype) for name, tensor in local.items()}
    infos: dict[str, TensorInfo] = {}
    for rank, held in enumerate(all_gather(mine)):
        for name, (shape, dtype) in held.items():
            holders = infos[name].holders if name in infos else ()
            infos[name] = TensorInfo(shape, dtype, (*holders, rank))
    return dict(sorted(infos.items()))


def _balanced_owners(tensors: dict[str, TensorInfo]) -> dict[str, int]:
    """One owner per tensor among its holders, largest tensors first, each to the holder with the fewest bytes so
    far (ties to the lowest rank): the same answer on every rank."""
    load: dict[int, int] = {}
    owners = {}
    by_size = sorted(tensors.items(), key=lambda item: (-_bytes(item[1]), item[0]))
    for name, info in by_size:
        owner = min(info.holders, key=lambda rank: (load.get(rank, 0), rank))
        owners[name] = owner
        load[owner] = load.get(owner, 0) + _bytes(info)
    return owners


def _bytes(info: TensorInfo) -> int:
    return torch.Size(info.shape).numel() * info.dtype.itemsize
