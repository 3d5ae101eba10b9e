"""The output layer under training.loss_chunk_size: the model returns its final hidden states, and the loss projects
them onto the vocabulary a chunk of tokens at a time (`torchpre.parallel.linear_cross_entropy`).

`chunk_output_layer` swaps a family's output nn.Linear (`ModelSpec.build.output_layer`) for a `ChunkedOutput` that holds
the same weight Parameter under the same name, so initialisation, tied embeddings, checkpoints, Hugging Face exports and
resumes with chunking on or off are unchanged. Its forward returns its input: the model, or the last pipeline stage,
outputs the final normalised hidden states [batch, seq, dim] where it output logits. The training loss and the
multiple-choice evaluation score them through the last stage's `ChunkedProjection`; a model that scores its own
hidden states inside its forward (DeepSeek-V3's multi-token prediction depths) calls `output_cross_entropy_sum`.
Under tensor parallelism `VocabParallelOutput` shards the weight over the vocabulary and gathers the input over the
sequence, as ColwiseParallel with loss parallel does for the nn.Linear.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from torchpre.errors import ConfigError
from torchpre.parallel.forward_inputs import IGNORE_INDEX
from torchpre.parallel.linear_cross_entropy import linear_cross_entropy, linear_log_probs


class ChunkedOutput(nn.Module):
    """An output layer whose logits are never made whole: `weight` [vocab, dim] as the bias-free nn.Linear it
    replaces, a forward that returns the hidden states, and the tokens per chunk that scoring them takes."""

    def __init__(self, weight: nn.Parameter, chunk_size: int) -> None:
        super().__init__()
        self.weight = weight
        self.chunk_size = chunk_size

    def forward(self, hidden: Tensor) -> Tensor:
        return hidden

    def extra_repr(self) -> str:
        return f"vocab={self.weight.shape[0]}, dim={self.weight.shape[1]}, chunk_size={self.chunk_size}"


def chunk_output_layer(model: nn.Module, path: str, chunk_size: int) -> None:
    """Replaces the bias-free nn.Linear at the dotted `path` of `model` (built, not yet parallelized) by a
    `ChunkedOutput` of `chunk_size` tokens holding its weight Parameter."""
    owner, _, name = path.rpartition(".")
    parent = model.get_submodule(owner)
    linear = getattr(parent, name, None)
    if type(linear) is not nn.Linear or linear.bias is not None:
        raise ConfigError(
            f"training.loss_chunk_size: the output layer '{path}' of {type(model).__name__} is a "
            f"{type(linear).__name__}, not a bias-free nn.Linear the chunked loss can replace. Set "
            "training.loss_chunk_size = 0."
        )
    setattr(parent, name, ChunkedOutput(linear.weight, chunk_size))


def output_cross_entropy_sum(output: nn.Module, hidden: Tensor, labels: Tensor) -> Tensor:
    """The summed token cross-entropy (fp32; `IGNORE_INDEX` labels add nothing) of the output layer `output` applied
    to `hidden`, inside a model's forward: chunked when it is a `ChunkedOutput`, else from its whole logits."""
    projected = output(hidden)
    if isinstance(output, ChunkedOutput):
        return linear_cross_entropy(projected, output.weight, labels, output.chunk_size)
    logits = projected.flatten(0, 1).float()
    return F.cross_entropy(logits, labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)


class ChunkedProjection:
    """The `ChunkedOutput` of a model part (the last pipeline stage) as the loss and evaluation use it after the
    forward. Under ZeRO-3 the part's FSDP root may have resharded the weight when the forward returned
    (parallelism.fsdp_reshard_after_forward), so both gather it first (`unshard`: a no-op when gathered), the gather
    the backward would start with anyway. The loss's backward finds it still gathered: only a forward of this part
    reshards it, and each is followed by its own loss, which gathers it again (a pipeline schedule computes the loss
    right after the last stage's forward). `compile` compiles the chunked loss (one graph, on one vocabulary shard)."""

    def __init__(self, part: nn.Module, compile: bool = False) -> None:
        outputs = [module for module in part.modules() if isinstance(module, ChunkedOutput)]
        if len(outputs) != 1:
            raise ValueError(f"expected one ChunkedOutput in the model part, found {len(outputs)}")
        self.output = outputs[0]
        self.fsdp = part if isinstance(part, FSDPModule) else None
        self._cross_entropy = torch.compile(linear_cross_entropy, fullgraph=True) if compile else linear_cross_entropy

    def cross_entropy_sum(self, hidden: Tensor, labels: Tensor) -> Tensor:
        """The summed token cross-entropy of the hidden states the part returned, fp32."""
        return self._cross_entropy(hidden, self._weight(), labels, self.output.chunk_size)

    def log_probs(self, hidden: Tensor, targets: Tensor) -> Tensor:
        """Each token's log-probability of its target, fp32 [tokens], from the hidden states [tokens, dim]."""
        return linear_log_probs(hidden, self._weight(), targets, self.output.chunk_size)

    def _weight(self) -> Tensor:
        if self.fsdp is not None:
            self.fsdp.unshard()
        return self.output.weight


class VocabParallelOutput(ParallelStyle):
    """Tensor parallelism of a `ChunkedOutput`: its weight sharded over the vocabulary (Shard(0), the embedding's
    placement, so tied weights stay one Parameter) and its input, laid out as `input_layout` (Shard(1) under sequence
    parallelism), returned as a Replicate DTensor: the chunked loss computes each rank's vocabulary shard of the
    logits of every token."""

    def __init__(self, input_layout: Placement) -> None:
        super().__init__()
        self.input_layout = input_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module, device_mesh, _shard_vocabulary, partial(_replicated_input, self.input_layout)
        )


def _shard_vocabulary(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    if isinstance(module, ChunkedOutput):
        module.weight = nn.Parameter(distribute_tensor(module.weight, mesh, [Shard(0)]))


def _replicated_input(layout: Placement, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> DTensor:
    hidden = inputs[0]
    if not isinstance(hidden, DTensor):
        hidden = DTensor.from_local(hidden, mesh, [layout], run_check=False)
    return hidden.redistribute(placements=[Replicate()])
