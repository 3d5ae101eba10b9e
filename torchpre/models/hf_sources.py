"""How each tensor of a family's model is made from a Hugging Face folder's tensors, one box at a time.

A family's adapter maps every name of its state dict to a `Source`: a folder tensor as it is (`Same`), q/k rows moved
from rotate-half order to adjacent pairs (`RotaryRows`), or per-expert weights stacked (`StackedExperts`). Given
`read(name, box)`, which returns a box of a folder tensor, `Source.read(read, box)` makes that box of the torchpre
tensor, so a rank that holds a shard reads the bytes of its shard and no others (a row-permuted box reads at most
one head's rows more at each end). A whole state dict is the same with every box whole (`whole_state_dict`), which
is how the families' `from_hf_state_dict` are written: one mapping for conversion and for sharded loading.

`check_folder` compares the folder's tensors (names and shapes) with what the sources read, before any byte is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from torchpre.errors import TorchpreError
from torchpre.models.state_dict_checks import check_tensors

Box = tuple[slice, ...]  # one slice per dimension, each with a start and a stop
Reader = Callable[[str, Box], Tensor]  # a box of a folder tensor, by the tensor's name


@dataclass(frozen=True)
class Copy:
    """A folder tensor that must equal the one a source reads (a tied output layer saved anyway, multi-token
    prediction's copies of the embedding and output layer): compared box by box, since torchpre holds it once."""

    name: str
    why: str


@dataclass(frozen=True)
class Zeros:
    """A folder tensor the model has no place for, which is only harmless when it is all zeros (a routing bias of a
    model without bias balancing): read whole, it is small."""

    name: str
    why: str


@dataclass(frozen=True)
class Same:
    """The folder tensor `name`, as it is."""

    name: str
    copies: tuple[Copy, ...] = ()
    zeros: tuple[Zeros, ...] = ()

    def hf_shapes(self, shape: torch.Size) -> dict[str, torch.Size]:
        return {self.name: shape, **{copy.name: shape for copy in self.copies}}

    def read(self, read: Reader, box: Box) -> Tensor:
        value = read(self.name, box)
        for copy in self.copies:
            if not torch.equal(read(copy.name, box), value):
                raise TorchpreError(f"{copy.name} differs from {self.name}: {copy.why}.")
        for zero in self.zeros:
            if bool(read(zero.name, (slice(None),)).any()):  # the whole (small) tensor
                raise TorchpreError(f"{zero.name} is not all zeros: {zero.why}.")
        return value


@dataclass(frozen=True)
class RotaryRows:
    """The q or k projection `name` of a rotate-half model (Hugging Face's Llama), with its rows in adjacent-pair
    order within each head of `head_dim` rows (Meta's layout, which torchpre's RoPE rotates)."""

    name: str
    head_dim: int

    def hf_shapes(self, shape: torch.Size) -> dict[str, torch.Size]:
        return {self.name: shape}

    def read(self, read: Reader, box: Box) -> Tensor:
        rows, rest = box[0], box[1:]
        first = rows.start // self.head_dim * self.head_dim
        stop = -(-rows.stop // self.head_dim) * self.head_dim
        block = read(self.name, (slice(first, stop), *rest))
        heads = (stop - first) // self.head_dim
        pairs = block.reshape(heads, 2, self.head_dim // 2, *block.shape[1:]).transpose(1, 2)
        return pairs.reshape(block.shape)[rows.start - first : rows.stop - first]


@dataclass(frozen=True)
class StackedExperts:
    """Routed experts' weights stacked as [experts, in, out] from one [out, in] `nn.Linear` weight per expert, the
    layout released folders and transformers' `save_pretrained` use."""

    names: tuple[str, ...]

    def hf_shapes(self, shape: torch.Size) -> dict[str, torch.Size]:
        return dict.fromkeys(self.names, torch.Size(shape[1:][::-1]))

    def read(self, read: Reader, box: Box) -> Tensor:
        experts, rows, columns = box
        return torch.stack([read(self.names[e], (columns, rows)).t() for e in range(experts.start, experts.stop)])


Source = Same | RotaryRows | StackedExperts


@dataclass(frozen=True)
class Sources:
    """Where every tensor of a model's state dict comes from, by its torchpre name, and the folder tensors left out
    on purpose (`dropped`: e.g. multi-token prediction layers a job without it does not train)."""

    by_name: dict[str, Source]
    dropped: frozenset[str] = frozenset()


def whole_box(shape: torch.Size) -> Box:
    return tuple(slice(0, size) for size in shape)


def check_folder(sources: Sources, shapes: Mapping[str, torch.Size], folder: Mapping[str, torch.Size]) -> None:
    """A TorchpreError naming the folder tensors the model lacks, those the folder lacks and those of another shape
    (`shapes`: the model's, by torchpre name; `folder`: the folder's, by Hugging Face name)."""
    expected: dict[str, torch.Size] = {}
    for name, source in sources.by_name.items():
        expected |= source.hf_shapes(shapes[name])
        if isinstance(source, Same):  # the zero biases: of any shape, read whole
            expected |= {zeros.name: folder.get(zeros.name, torch.Size([0])) for zeros in source.zeros}
    given = {name: torch.empty(shape, device="meta") for name, shape in folder.items() if name not in sources.dropped}
    check_tensors(given, expected, "Hugging Face folder")


def whole_state_dict(
    sources: Sources, shapes: Mapping[str, torch.Size], hf_state_dict: Mapping[str, Tensor]
) -> dict[str, Tensor]:
    """Every source read whole from an in-memory Hugging Face state dict (`shapes`: the model's, by torchpre name),
    after `check_folder`."""
    check_folder(sources, shapes, {name: tensor.shape for name, tensor in hf_state_dict.items()})

    def read(name: str, box: Box) -> Tensor:
        return hf_state_dict[name][box]

    return {fqn: source.read(read, whole_box(shapes[fqn])) for fqn, source in sources.by_name.items()}

