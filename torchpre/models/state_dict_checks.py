"""Checks that the families' Hugging Face adapters share: a state dict against the model's names and shapes, and
the output copy of a tied embedding."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from torchpre.errors import TorchpreError

_LISTED = 6  # tensors named per kind of problem in an error


def without_tied_copy(state_dict: Mapping[str, Tensor], copy: str, embedding: str) -> dict[str, Tensor]:
    """`state_dict` without the output copy of a tied embedding, after checking it is one."""
    if copy in state_dict and embedding in state_dict and not torch.equal(state_dict[copy], state_dict[embedding]):
        raise TorchpreError(
            f"{copy} differs from {embedding}, but the model ties them (tie_word_embeddings); "
            "these weights belong to a model with untied embeddings."
        )
    return {name: tensor for name, tensor in state_dict.items() if name != copy}


def check_tensors(given: Mapping[str, Tensor], expected: Mapping[str, torch.Size], what: str) -> None:
    """Names the tensors of `given` that `expected` lacks, those it misses and those of another shape."""
    missing = sorted(expected.keys() - given.keys())
    unknown = sorted(given.keys() - expected.keys())
    misshapen = [
        f"{name} {tuple(given[name].shape)} (expected {tuple(shape)})"
        for name, shape in expected.items()
        if name in given and given[name].shape != shape
    ]
    problems = [
        f"{len(names)} {label}: {', '.join(names[:_LISTED])}" + (", ..." if len(names) > _LISTED else "")
        for label, names in (("missing", missing), ("unknown", unknown), ("with the wrong shape", misshapen))
        if names
    ]
    if problems:
        raise TorchpreError(f"The {what} does not fit the model args: " + "; ".join(problems) + ".")
