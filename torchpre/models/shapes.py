"""A model's shape on top of its flavor: model.dim, model.n_layers, model.n_heads and model.n_kv_heads.

A family's args class says which of these it takes (`shape_keys`) and which of its other widths follow the model
width (`width_fields`: a MoE's expert widths, DeepSeek-V3's latent ranks), which scale with `dim` in the flavor's
proportion; a width the args derive from `dim` (Llama 3's SwiGLU width) follows by itself.
"""

from __future__ import annotations

import dataclasses
import math

from torchpre.errors import ConfigError
from torchpre.models.args import ModelArgs

SHAPE_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads")


def with_shape(args: ModelArgs, where: str, **shape: int) -> ModelArgs:
    """`args` with each of `shape` (SHAPE_KEYS; 0 = keep the args' own) replaced, and the width fields scaled with
    `dim`. A ConfigError names the key that `where` (e.g. "model.flavor = 'tiny'") cannot take, or the shape that does
    not hold together."""
    given = {key: value for key, value in shape.items() if value}
    taken = type(args).shape_keys
    refused = [key for key in given if key not in taken]
    if refused:
        takes = f"it takes model.{', model.'.join(taken)}" if taken else "its args take no shape keys"
        raise ConfigError(
            f"model.{refused[0]} = {given[refused[0]]} with {where}: {takes}. Remove the key (0 = the flavor's)."
        )
    if not given:
        return args
    changes = dict(given)
    if "dim" in given:
        changes |= {name: _scaled(args, name, given["dim"], where) for name in type(args).width_fields}
    try:
        return dataclasses.replace(args, **changes)
    except ConfigError as error:
        settings = ", ".join(f"model.{key} = {value}" for key, value in given.items())
        raise ConfigError(f"{settings} on {where}: {error}. Choose a shape that holds together.") from None


def _scaled(args: ModelArgs, name: str, dim: int, where: str) -> int:
    """The width field `name` of `args` scaled by dim / args.dim; it must stay a whole number."""
    width = getattr(args, name)
    if width * dim % args.dim:
        raise ConfigError(
            f"model.dim = {dim} on {where}: its {name} ({width} at dim {args.dim}) follows the width, and "
            f"{width} x {dim} / {args.dim} is not a whole number. Use a dim that scales it exactly (a multiple of "
            f"{args.dim // math.gcd(width, args.dim)})."
        )
    return width * dim // args.dim
