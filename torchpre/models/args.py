"""What the code outside a model family reads of its args: the one typed boundary between a family and the trainer,
generation, conversion and the planner.

Every family's args declare all of it, with a default where the family lacks the feature (no multi-token
prediction: `mtp_depth` 0; no dense first blocks: `first_k_dense` 0; a forward without µP's multipliers: the standard
`parametrization`, and `parametrized` False), so no caller asks an args object what it has.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

from torchpre.models.parametrization import Parametrization


class ModelArgs(Protocol):
    """A family's args (`ModelSpec.flavors`, `ModelSpec.args_from_job`), as the rest of torchpre reads them.

    The class attributes say which model.* keys the args take: `shape_keys` the shape keys
    (torchpre.models.shapes), `width_fields` the widths that scale with model.dim, `parametrized` whether
    model.parametrization beyond 'sp' applies (the forward has the multipliers), `predicts_ahead` whether
    model.mtp_depth and model.mtp_loss_weight apply (multi-token prediction)."""

    shape_keys: ClassVar[tuple[str, ...]]
    width_fields: ClassVar[tuple[str, ...]]
    parametrized: ClassVar[bool]
    predicts_ahead: ClassVar[bool]

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_seq_len(self) -> int: ...

    @property
    def dim(self) -> int: ...

    @property
    def n_layers(self) -> int: ...

    @property
    def n_heads(self) -> int: ...

    @property
    def n_kv_heads(self) -> int | None: ...

    @property
    def tie_word_embeddings(self) -> bool: ...

    @property
    def parametrization(self) -> Parametrization: ...

    @property
    def mtp_depth(self) -> int:
        """Multi-token prediction depths after the main model; 0: none."""
        ...

    @property
    def first_k_dense(self) -> int:
        """How many first blocks have a dense feed-forward in a model of routed experts; 0 in a dense model."""
        ...
