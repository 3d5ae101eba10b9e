"""What the code outside a model family reads of its args: the one typed boundary between a family and the trainer,
generation, conversion and the planner.

Every family's args declare all of it, with a default where the family lacks the feature (`ArgsDefaults`: no
multi-token prediction, no dense first blocks, a forward without µP's multipliers), so no caller asks an args object
what it has. `register_model` refuses a flavor whose args do not.
"""

from __future__ import annotations

from typing import ClassVar, Protocol, runtime_checkable

from torchpre.models.parametrization import Parametrization


@runtime_checkable
class ModelArgs(Protocol):
    """A family's args (`ModelSpec.flavors`, `ModelSpec.args_from_job`), as the rest of torchpre reads them.

    The class attributes say which model.* keys the args take: `shape_keys` the shape keys
    (torchpre.models.shapes), `width_fields` the widths that scale with model.dim, `parametrized` whether
    model.parametrization beyond 'sp' applies (the forward has the multipliers), `predicts_ahead` whether
    model.mtp_depth and model.mtp_loss_weight apply (multi-token prediction), `selectable_mlp` whether model.mlp
    applies (a dense Llama-style feed-forward that may be SwiGLU or GELU)."""

    shape_keys: ClassVar[tuple[str, ...]]
    width_fields: ClassVar[tuple[str, ...]]
    parametrized: ClassVar[bool]
    predicts_ahead: ClassVar[bool]
    selectable_mlp: ClassVar[bool]

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_seq_len(self) -> int: ...

    @property
    def dim(self) -> int: ...

    @property
    def n_layers(self) -> int: ...

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


class ArgsDefaults:
    """The optional part of `ModelArgs` for a family without those features, to derive a family's args from: no
    model.* shape keys, no µP multipliers (the standard parametrization), no multi-token prediction, every block
    dense, no choice of feed-forward. A family that has one declares it over the default."""

    shape_keys: ClassVar[tuple[str, ...]] = ()
    width_fields: ClassVar[tuple[str, ...]] = ()
    parametrized: ClassVar[bool] = False
    predicts_ahead: ClassVar[bool] = False
    selectable_mlp: ClassVar[bool] = False
    parametrization: ClassVar[Parametrization] = Parametrization()
    mtp_depth: ClassVar[int] = 0
    first_k_dense: ClassVar[int] = 0
