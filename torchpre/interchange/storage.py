"""A Hugging Face folder as a `torch.distributed.checkpoint` storage: DCP loads it into any sharded state dict.

The storage describes the model's tensors under torchpre's names and whole shapes, each as one chunk; DCP's load
planner then asks every rank for the boxes of those tensors that its state dict holds (a DTensor's shard under
TP, ZeRO-1/2's masters, FSDP, expert parallelism; its own stage's tensors under PP), exactly as it resharded a
saved checkpoint, and this reader makes each box from the folder's tensors (`Source.read`: q/k rows moved, experts
stacked, FP8 dequantized) and copies it into place. So a rank reads the bytes of the shards it holds and no
others, and the load is the same code for one process (`hf-to-dcp`) and for a job of any layout.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from torchpre.interchange.reader import HFFolder
from torchpre.models.hf_sources import Box, Source, StackedExperts


class HFStorageReader(StorageReader):
    """Reads `sources` (torchpre name -> `Source`, the model's tensors of shape `shapes`) from `folder`."""

    def __init__(self, folder: HFFolder, sources: Mapping[str, Source], shapes: Mapping[str, torch.Size]):
        super().__init__()
        self.folder, self.sources, self.shapes = folder, sources, shapes

    def reset(self, checkpoint_id: object = None) -> None:
        pass

    def read_metadata(self, *args: object, **kwargs: object) -> Metadata:
        return Metadata(
            state_dict_metadata={
                name: TensorStorageMetadata(
                    TensorProperties(dtype=self.folder.dtype(first_name(source))),
                    self.shapes[name],
                    [ChunkStorageMetadata(torch.Size([0] * len(self.shapes[name])), self.shapes[name])],
                )
                for name, source in self.sources.items()
            }
        )

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: object, **kwargs: object) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Each box in the order the folder stores the tensors, every file unmapped after each box is copied."""
        for item in sorted(plan.items, key=self._position):
            with self.folder.reading():
                value = self.sources[item.storage_index.fqn].read(self.folder.read, box_of(item))
                target = planner.resolve_tensor(item).detach()
                target.copy_(value)
                del value
            planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: object) -> bool:
        return False

    def _position(self, item: ReadItem) -> tuple[str, str, tuple[int, ...]]:
        name = first_name(self.sources[item.storage_index.fqn])
        return str(self.folder.stored[name].path), name, tuple(item.storage_offsets)


def box_of(item: ReadItem) -> Box:
    """The box of the tensor a read item asks for: its offsets and lengths in the whole tensor (one chunk)."""
    return tuple(slice(start, start + length) for start, length in zip(item.storage_offsets, item.lengths))


def first_name(source: Source) -> str:
    """The folder tensor a source reads first: its dtype is the source's, its file where it is read."""
    return source.names[0] if isinstance(source, StackedExperts) else source.name
