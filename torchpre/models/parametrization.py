"""Parametrizations: how a model's init, learning rates and forward multipliers scale with its width and depth, so
that hyperparameters tuned on a small model hold on a large one.

"sp" is the standard parametrization: the family's own init and one learning rate. "mup" is the maximal update
parametrization (µP; Yang et al. 2022, Tensor Programs V), relative to a base shape at which the model is exactly the
standard one: as the width grows, every layer's update keeps its size, so the best learning rate stays where it was.
"complete_p" (CompleteP, Dey et al. 2025: depth-µP with α = 1) is µP that also multiplies each residual branch by
base depth / n_layers, so that it holds across depth too.

Every factor comes from global shapes, never a rank's shard: the forward multipliers from the args, a parameter's
factors from its whole shape against the same parameter's in the base model. Per parameter, with m_in and m_out the
ratios of its fan-in and fan-out to the base model's (a matrix is [out, in], stacked experts [experts, in, out]):

| kind | init std | Adam-like lr | SGD lr |
|---|---|---|---|
| vocabulary (embedding, output layer) | x1 | x1 | x m_width |
| hidden: fan-in and fan-out scale | x m_in^-1/2 | / m_in | x m_out / m_in |
| readout: only the fan-in scales (a router) | / m_in | / m_in | / m_in |
| input: only the fan-out scales | x1 | x1 | x m_out |
| vector (norm gain, bias) | x1 | x1 | x its ratio |

Weight decay is multiplied by the inverse of the learning rate's factor (lr x decay, the decay per step, stays the
base's), as the `mup` package's MuAdamW and MuSGD and CompleteP do. Under complete_p the Adam-like optimizers' eps is
divided by m_width x m_depth, as CompleteP's reference implementation does. The forward: the embedding's output times
`embedding_multiplier`, the logits times `logit_multiplier` / m_width, the attention's softmax scale sqrt(base head
dim) / head dim (the queries times sqrt(base head dim / head dim)), and under complete_p each residual branch times
1 / m_depth. Each parameter is drawn as the base model's (its std, and a block's as the base model's block at the same
relative depth), times its init factor: at the base shape the model is the standard one.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

import torch
from torch import Tensor, nn

from torchpre.errors import ConfigError
from torchpre.models.init import Fill, InitRule, ParamInit

PARAMETRIZATIONS = ("sp", "mup", "complete_p")
Update = Literal["adaptive", "sgd"]  # entrywise-normalised updates (Adam, AdamW, Adagrad, RMSprop), or raw gradients
Shapes = tuple[tuple[str, tuple[int, ...]], ...]


class ScaledArgs(Protocol):
    """The shape µP scales from, in the args of a parametrized family (llama3, moe, deepseek_v3). ModelArgs lacks
    `attention_head_dim`: model_args (torchpre.assembly.args) parametrizes only these families."""

    @property
    def dim(self) -> int: ...

    @property
    def n_layers(self) -> int: ...

    @property
    def attention_head_dim(self) -> int: ...


Args = TypeVar("Args", bound=ScaledArgs)


@dataclass(frozen=True)
class Factors:
    """One parameter's factors on its init std and on the optimizer's lr, weight decay and eps."""

    init_std: float = 1.0
    lr: float = 1.0
    weight_decay: float = 1.0
    eps: float = 1.0


@dataclass(frozen=True)
class Parametrization:
    """A model's parametrization (see the module doc); the default is the standard one, which changes nothing.

    `base_shapes` and `shapes` hold each parameter's global shape in the base model and in this one, by name with the
    block indices as `*` (blocks of a kind share their shapes); `vocabulary` the names of the embedding and output
    matrices."""

    name: str = "sp"
    width: float = 1.0  # dim / base dim
    n_layers: int = 0
    base_depth: int = 0
    embedding_multiplier: float = 1.0
    logit_multiplier: float = 1.0
    attention_multiplier: float = 1.0  # on the queries, over the attention kernel's own 1 / sqrt(head dim)
    residual_multiplier: float = 1.0
    base_shapes: Shapes = ()
    shapes: Shapes = ()
    vocabulary: frozenset[str] = frozenset()
    base_args: ScaledArgs | None = None  # the same model at the base shape, in the standard parametrization

    @property
    def is_standard(self) -> bool:
        return self.name == "sp"

    @property
    def depth(self) -> float:
        """n_layers / base depth under complete_p; 1 otherwise (µP does not scale with depth)."""
        return self.n_layers / self.base_depth if self.name == "complete_p" else 1.0

    def factors(self, name: str, shape: Sequence[int], update: Update = "adaptive") -> Factors:
        """The factors of the parameter `name` whose whole (global) shape is `shape`, for an optimizer whose update is
        `update`."""
        if self.is_standard:
            return Factors()
        init_std, lr = self._init_and_lr(block_pattern(name), tuple(shape), update)
        eps = 1.0 / (self.width * self.depth) if self.name == "complete_p" and update == "adaptive" else 1.0
        return Factors(init_std, lr, 1.0 / lr, eps)

    def _init_and_lr(self, key: str, shape: tuple[int, ...], update: Update) -> tuple[float, float]:
        if key in self.vocabulary:
            return 1.0, 1.0 if update == "adaptive" else self.width
        base = dict(self.base_shapes)[key]
        if len(shape) < 2:
            return 1.0, 1.0 if update == "adaptive" else shape[0] / base[0]
        fan_in = -1 if len(shape) == 2 else -2  # [out, in]; stacked experts [experts, in, out]
        fan_out = -2 if len(shape) == 2 else -1
        m_in, m_out = shape[fan_in] / base[fan_in], shape[fan_out] / base[fan_out]
        if m_in == 1.0:  # input-like, or of fixed size
            return 1.0, 1.0 if update == "adaptive" else m_out
        if m_out != 1.0:  # hidden
            return m_in**-0.5, 1 / m_in if update == "adaptive" else m_out / m_in
        return 1 / m_in, 1 / m_in  # readout

    def init_rule(self, rule_of: Callable[..., InitRule]) -> InitRule:
        """The model's init from `rule_of`, the family's standard init: `rule_of()` (the model's own) in the standard
        parametrization; else `rule_of(base_args)`, the base model's, each parameter's std scaled by its `factors`
        (read off the whole tensor it fills), a block drawn as the base model's block at the same relative depth
        (under µP the depth is the base's)."""
        if self.is_standard:
            return rule_of()
        rule = rule_of(self.base_args)

        def scaled(fqn: str) -> ParamInit:
            source = self._at_relative_depth(fqn)
            init = rule(source)
            return ParamInit(fqn if init.key == source else init.key, ScaledFill(init.fill, fqn, self))

        return scaled

    def _at_relative_depth(self, fqn: str) -> str:
        if self.n_layers == self.base_depth:
            return fqn
        return re.sub(r"^layers\.(\d+)\.", lambda m: f"layers.{int(m[1]) * self.base_depth // self.n_layers}.", fqn)

    def describe(self) -> str:
        """One line for the log."""
        if self.is_standard:
            return "sp"
        depth = f", residual branches x{self.residual_multiplier:.4g}" if self.name == "complete_p" else ""
        return (
            f"{self.name}: width x{self.width:.4g} of the base; logits x{self.logit_multiplier:.4g}, embedding "
            f"x{self.embedding_multiplier:.4g}, queries x{self.attention_multiplier:.4g}{depth}"
        )


@dataclass(frozen=True)
class ScaledFill:
    """A `Fill` followed by the parameter's init factor, computed from the whole tensor it fills."""

    fill: Fill
    name: str
    parametrization: Parametrization

    def __call__(self, tensor: Tensor, *, generator: torch.Generator) -> None:
        self.fill(tensor, generator=generator)
        factor = self.parametrization.factors(self.name, tensor.shape).init_std
        if factor != 1.0:
            tensor.mul_(factor)


def fold_multipliers(
    state: Mapping[str, Tensor], parametrization: Parametrization, weights: Mapping[str, tuple[str, ...]], tied: bool
) -> dict[str, Tensor]:
    """`state` (torchpre names) with each multiplier of the forward multiplied into the weights whose output it scales,
    for an export to an architecture without multipliers: `weights` maps "embedding", "logits", "queries" and
    "residual" to the fnmatch patterns of those weights (meta tensors stay meta). With `tied` embeddings one matrix
    serves both ends, so the embedding and logit multipliers fold only when they are equal; a ConfigError says so."""
    if parametrization.is_standard:
        return dict(state)
    p = parametrization
    factors = {"embedding": p.embedding_multiplier, "logits": p.logit_multiplier,
               "queries": p.attention_multiplier, "residual": p.residual_multiplier}  # fmt: skip
    if tied and factors["embedding"] != factors["logits"]:
        raise ConfigError(
            f"model.parametrization = '{p.name}' with tied embeddings: the embedding multiplier "
            f"{factors['embedding']:.4g} and the logit multiplier {factors['logits']:.4g} differ, so they cannot fold "
            "into the one matrix both use, and this Hugging Face architecture has no multipliers of its own. Train "
            "with untied embeddings to export, or keep the checkpoint in torchpre's format."
        )
    folded = dict(state)
    for multiplier, patterns in weights.items():
        if factors[multiplier] == 1.0:
            continue
        for name in [n for n in folded if any(fnmatch.fnmatchcase(n, pattern) for pattern in patterns)]:
            folded[name] = folded[name] * factors[multiplier]
    return folded


def block_pattern(name: str) -> str:
    """A parameter name with its block indices as `*` ("layers.3.attention.wq.weight" -> "layers.*.attention...")."""
    return re.sub(r"(?<=\.)\d+(?=\.)", "*", name)


@dataclass(frozen=True)
class Settings:
    """What a job sets (the model.parametrization and model.mup_* keys), the base shape resolved."""

    name: str
    base_head_dim: int  # 0: the base model's own
    embedding_multiplier: float = 1.0
    logit_multiplier: float = 1.0


def parametrize(model_cls: Callable[[Args], nn.Module], args: Args, base_args: Args, settings: Settings) -> Args:
    """`args` with the `Parametrization` `settings` describes relative to `base_args` (the same model at the base
    width and depth), both built on the meta device to read every parameter's global shape."""
    shapes, vocabulary = _shapes(model_cls, args)
    base_shapes, _ = _shapes(model_cls, base_args)
    known = dict(base_shapes)
    missing = [name for name, _ in shapes if name not in known]
    if missing:
        raise ConfigError(
            f"model.mup_base_depth = {base_args.n_layers}: the base model has no '{missing[0]}' (its blocks are not of "
            "every kind this model's are). Use a base depth that holds each kind of block."
        )
    width = args.dim / base_args.dim
    head_dim, base_head_dim = args.attention_head_dim, settings.base_head_dim or base_args.attention_head_dim
    parametrization = Parametrization(
        name=settings.name,
        width=width,
        n_layers=args.n_layers,
        base_depth=base_args.n_layers,
        embedding_multiplier=settings.embedding_multiplier,
        logit_multiplier=settings.logit_multiplier / width,
        attention_multiplier=(base_head_dim / head_dim) ** 0.5,
        residual_multiplier=base_args.n_layers / args.n_layers if settings.name == "complete_p" else 1.0,
        base_shapes=base_shapes,
        shapes=shapes,
        vocabulary=vocabulary,
        base_args=base_args,
    )
    return dataclasses.replace(args, parametrization=parametrization)


def _shapes(model_cls: Callable[[Args], nn.Module], args: Args) -> tuple[Shapes, frozenset[str]]:
    """Each parameter kind's global shape (in the order of `named_parameters`, tied names included) and the names of
    the vocabulary matrices, from the model built on the meta device."""
    with torch.device("meta"):
        model = model_cls(args)
    shapes: dict[str, tuple[int, ...]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        shapes.setdefault(block_pattern(name), tuple(param.shape))
    return tuple(shapes.items()), frozenset(block_pattern(name) for name in model.vocabulary_parameters())
