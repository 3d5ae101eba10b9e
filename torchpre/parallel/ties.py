"""Parameters that several modules share (tied embeddings), kept shared through `parallelize`.

`to_empty` and tensor-parallel sharding give every module a Parameter of its own, so a weight that two modules
share on the model as built (transformers' `tie_word_embeddings`, a model assigning `head.weight = embed.weight`)
would silently become two weights that train apart. `parallelize` reads the shared Parameters off the model as
given (`tie_groups`, before anything is materialised), re-ties them in each part that holds them (`retie`), and
refuses by name a layout that cannot keep them one weight: a tensor-parallel plan that shards the copies unlike
each other (`check_tied_placements`), or copies on pipeline stages other than the first and the last, whose
gradients the optimizer sums for one pair only (`cross_stage_pair`).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.distributed.tensor import DTensor

from torchpre.errors import ConfigError

TieGroup = tuple[str, ...]


def shared_parameters(model: nn.Module) -> list[TieGroup]:
    """The names of each Parameter that more than one module of `model` holds, in registration order."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [tuple(group) for group in names.values() if len(group) > 1]


def tie_groups(model: nn.Module, explicit: tuple[str, str] | None) -> list[TieGroup]:
    """The shared Parameters of `model`, with the pair `explicit` (ParallelPlan.tied_weights) merged in: a pair the
    model does not share on its own is tied too."""
    groups = [list(group) for group in shared_parameters(model)]
    if explicit is not None:
        overlapping = [group for group in groups if set(group) & set(explicit)]
        merged = [name for group in overlapping for name in group]
        merged += [name for name in explicit if name not in merged]
        groups = [group for group in groups if group not in overlapping] + [merged]
    return [tuple(group) for group in groups]


def stage_holds(stage_modules: Sequence[str], param: str) -> bool:
    """Whether a pipeline stage keeping the modules `stage_modules` (`prune_to`) holds the parameter `param`: its
    module is kept, or lies on the path to a kept module."""
    owner = param.rpartition(".")[0]
    return any(
        owner == kept or owner.startswith(f"{kept}.") or kept.startswith(f"{owner}.") or not owner
        for kept in stage_modules
    )


def cross_stage_pair(groups: Sequence[TieGroup], stage_modules: Sequence[Sequence[str]]) -> tuple[str, str] | None:
    """The one pair of tied names that lives on two pipeline stages, as (first stage's, last stage's); None when
    every group lies within one stage. Raises ConfigError for ties the optimizer cannot keep: a group spread other
    than as one name on the first stage and one on the last, or more than one such group."""
    last = len(stage_modules) - 1
    pairs = []
    for group in groups:
        stages = {name: [s for s, kept in enumerate(stage_modules) if stage_holds(kept, name)] for name in group}
        if len({s for held in stages.values() for s in held}) <= 1:
            continue
        ends = sorted(group, key=lambda name: stages[name])
        if len(group) != 2 or [stages[ends[0]], stages[ends[1]]] != [[0], [last]]:
            where = "; ".join(f"{name} on stage(s) {', '.join(map(str, held))}" for name, held in stages.items())
            raise ConfigError(
                f"The model shares one Parameter between {', '.join(group)} ({where} of {last + 1}), and pipeline "
                "parallelism keeps a shared Parameter only as two copies on the first and the last stage (tied "
                "embeddings). Split the stages so that the copies lie there or together, or untie the weights."
            )
        pairs.append((ends[0], ends[1]))
    if len(pairs) > 1:
        raise ConfigError(
            f"The model shares {len(pairs)} Parameters across pipeline stages ({'; '.join(map(' and '.join, pairs))}); "
            "pipeline parallelism keeps one such pair (tied embeddings). Split the stages so that the others lie "
            "within one stage, or untie them."
        )
    return pairs[0] if pairs else None


def check_tied_placements(part: nn.Module, groups: Sequence[TieGroup]) -> None:
    """Refuses a sharding under which the copies of one shared Parameter that `part` holds differ (one sharded, one
    replicated, or sharded on other dimensions or meshes): they could not be one Parameter again."""
    held = dict(part.named_parameters(remove_duplicate=False))
    for group in groups:
        layouts = {name: _layout(held[name]) for name in group if name in held}
        if len(set(layouts.values())) > 1:
            described = "; ".join(f"{name}: {layout}" for name, layout in layouts.items())
            raise ConfigError(
                f"The model shares one Parameter between {', '.join(layouts)}, but the tensor-parallel plan shards "
                f"the copies differently ({described}). Give their modules styles that shard the weight alike "
                "(e.g. a vocabulary-parallel embedding with a column-parallel output layer), leave both "
                "replicated, or untie the weights."
            )


def _layout(param: nn.Parameter) -> str:
    if isinstance(param, DTensor):
        return f"{tuple(param.placements)} over {param.device_mesh.mesh_dim_names}, shape {tuple(param.shape)}"
    return f"replicated, shape {tuple(param.shape)}"


def retie(part: nn.Module, groups: Sequence[TieGroup]) -> None:
    """Makes every name of a group that `part` holds use the Parameter of the group's first held name."""
    held = dict(part.named_parameters(remove_duplicate=False))
    for group in groups:
        names = [name for name in group if name in held]
        for name in names[1:]:
            owner, _, attribute = name.rpartition(".")
            setattr(part.get_submodule(owner), attribute, held[names[0]])
