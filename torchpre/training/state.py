"""The training loop's own entries of a checkpoint: the model's weights (loaded through the optimizer's fp32
masters) and the loop's progress (its step, the global batch it trains with, and the layout that saved it)."""

from typing import Any

import torch

from torchpre.checkpoint.layout import LAYOUT_KEYS, STAGE_KEYS
from torchpre.optim.distributed_optimizer import DistributedOptimizer
from torchpre.parallel.api import ParallelModel
from torchpre.step_rules.batch import CurrentBatch

# Entries of the "train" state that checkpoints written before they were recorded lack.
OPTIONAL_KEYS = ("global_batch_size", "dp", "tp", "pp", "ep", "cp", "accumulation_steps", "data_stages", *STAGE_KEYS)


class ModelState:
    """The "model" entry: this rank's parameters (and persistent buffers) by their name in the full model, DTensor
    shards under TP; each pipeline stage its own names. Loads go through the optimizer's fp32 masters
    (`DistributedOptimizer.model_targets`), which then write the parameters, so a dtype change between save and
    load never goes through a rounded copy."""

    def __init__(self, model: ParallelModel, optimizer: DistributedOptimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = {}
        for part in self.model.parts:
            state.update(part.state_dict())
        return state

    def load_targets(self, saved: set[str]) -> dict[str, torch.Tensor]:
        return self.optimizer.model_targets(self.state_dict(), saved)

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.optimizer.parameters_from_masters()


class TrainProgress:
    """The "train" entry: the optimizer steps taken, the global batch size they were taken with (a resume with
    training.global_batch_size = -1 keeps it), this job's layout (`LAYOUT_KEYS`, with the world size), sequence
    length and RoPE (`STAGE_KEYS`), and its data stages (`StageTable.record`, a JSON value), so that a resume under
    another one can say what changed without reading the checkpoint's config.toml; the batch and sequence length are
    the `batch`'s now. After a load, `saved` holds the checkpoint's numbers and `saved_stages` its stages (None in a
    checkpoint saved before they were)."""

    def __init__(self, batch: CurrentBatch, layout: dict[str, float], stages: list[dict[str, Any]]):
        self.step = 0
        self.batch = batch
        self._layout = layout
        self.stages = stages
        self.saved: dict[str, float] = {}
        self.saved_stages: object = None

    @property
    def global_batch_size(self) -> int:
        return self.batch.sizes.global_batch_size

    @property
    def layout(self) -> dict[str, float]:
        sizes = self.batch.sizes
        return self._layout | {"accumulation_steps": sizes.accumulation_steps, "seq_len": sizes.seq_len}

    def state_dict(self) -> dict[str, Any]:
        progress = {"step": self.step, "global_batch_size": self.global_batch_size}
        return {**progress, **self.layout, "data_stages": self.stages}

    def load_targets(self, saved: set[str]) -> dict[str, Any]:
        state = self.state_dict()
        return {key: value for key, value in state.items() if key not in OPTIONAL_KEYS or f"train.{key}" in saved}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        numbers = {key: value for key, value in state_dict.items() if key != "data_stages"}
        self.saved_stages = state_dict.get("data_stages")
        self.saved = {key: value if isinstance(value, float) else int(value) for key, value in numbers.items()}
        self.step = int(self.saved["step"])

    @property
    def saved_layout(self) -> dict[str, int]:
        """The saving job's `LAYOUT_KEYS` the loaded checkpoint holds."""
        return {key: int(self.saved[key]) for key in LAYOUT_KEYS if key in self.saved}
