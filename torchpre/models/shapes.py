"""A model's shape on top of its flavor: model.dim, model.n_layers, model.n_heads and model.n_kv_heads.

A family's args class says which of these it takes (`shape_keys`) and which of its other widths follow the model
width (`width_fields`: a MoE's expert widths, DeepSeek-V3's latent ranks), which scale with `dim` in the flavor's
proportion; a width the args derive from `dim` (Llama 3's SwiGLU width) follows by itself. The [model] step
(`torchpre.assembly.args.model_args`) refuses a key the args do not take, or a dim that does not scale a width
exactly, before any work; `with_shape` applies keys it has checked.
"""

from __future__ import annotations

import dataclasses

from torchpre.models.args import ModelArgs

SHAPE_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads")


def with_shape(args: ModelArgs, **shape: int) -> ModelArgs:
    """`args` with each of `shape` (SHAPE_KEYS; 0 = keep the args' own) replaced, and the width fields scaled with
    `dim`; the family's args check the shape holds together (their `__post_init__`)."""
    given = {key: value for key, value in shape.items() if value}
    assert set(given) <= set(type(args).shape_keys), f"shape keys {sorted(given)} on {type(args).__name__}"
    if not given:
        return args
    changes = dict(given)
    if "dim" in given:
        changes |= {name: scaled_width(args, name, given["dim"]) for name in type(args).width_fields}
    return dataclasses.replace(args, **changes)


def scaled_width(args: ModelArgs, name: str, dim: int) -> int:
    """The width field `name` of `args` scaled by dim / args.dim, which the [model] step checked is whole."""
    width = getattr(args, name)
    assert width * dim % args.dim == 0, f"{name} = {width} at dim {args.dim} does not scale to dim {dim}"
    return width * dim // args.dim
