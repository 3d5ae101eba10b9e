"""The model's shape and parametrization keys of the job config: model.dim, model.n_layers, model.n_heads and
model.n_kv_heads on top of a flavor (torchpre.models.shapes), model.parametrization and the model.mup_* keys as the
`Settings` that `model_args` applies with the base shape (torchpre.models.parametrization); the optimizer's factors of
the parametrized model. Where a key cannot apply, it is refused by name before any work.
"""

from collections.abc import Sequence

from torchpre.config.job_config import Model
from torchpre.errors import ConfigError
from torchpre.models.args import ModelArgs
from torchpre.models.parametrization import Settings
from torchpre.models.shapes import SHAPE_KEYS, with_shape
from torchpre.optim.param_scales import ParamScales
from torchpre.optim.registry import get_optimizer

MUP_KEYS = ("mup_base_dim", "mup_base_depth", "mup_base_head_dim", "mup_embedding_multiplier", "mup_logit_multiplier")
_DEFAULTS = Model()


def with_model_shape(m: Model, args: ModelArgs, **base: int) -> ModelArgs:
    """The flavor's `args` with the model.* shape keys (`base` replaces some of them: the base shape of a
    parametrization)."""
    shape = {key: getattr(m, key) for key in SHAPE_KEYS} | base
    return with_shape(args, f"model.name = '{m.name}', model.flavor = '{m.flavor}'", **shape)


def refuse_shape_keys(m: Model, why: str) -> None:
    """A ConfigError naming the first shape key that is set, for a model whose shape comes from elsewhere."""
    for key in SHAPE_KEYS:
        if getattr(m, key):
            raise ConfigError(f"model.{key} = {getattr(m, key)}: {why}. Remove the key (0 = unset).")


def parametrization_settings(m: Model) -> Settings | None:
    """What model.parametrization and the model.mup_* keys set (None: the standard parametrization, under which the
    mup keys are refused); whether the family and the optimizer can take it is checked where the args are known
    (`torchpre.assembly.args`)."""
    if m.parametrization == "sp":
        _refuse_set(m, MUP_KEYS, "they apply under model.parametrization = 'mup' or 'complete_p'")
        return None
    if m.parametrization == "mup":
        _refuse_set(m, ("mup_base_depth",), "the base depth is read by model.parametrization = 'complete_p' only")
    return Settings(m.parametrization, m.mup_base_head_dim, m.mup_embedding_multiplier, m.mup_logit_multiplier)


def optimizer_scales(args: ModelArgs, optimizer_name: str) -> ParamScales | None:
    """The per-parameter factors of the model's parametrization for the optimizer `optimizer_name` (its rule,
    `OptimizerSpec.mup_update`); None in the standard parametrization."""
    parametrization = args.parametrization
    if parametrization.is_standard:
        return None
    update = get_optimizer(optimizer_name).mup_update

    def factors(name: str, shape: Sequence[int]) -> tuple[float, float, float]:
        f = parametrization.factors(name, shape, update)
        return f.lr, f.weight_decay, f.eps

    return ParamScales(factors, parametrization.shapes)


def _refuse_set(m: Model, keys: tuple[str, ...], why: str) -> None:
    for key in keys:
        if getattr(m, key) != getattr(_DEFAULTS, key):
            raise ConfigError(
                f"model.{key} = {getattr(m, key)} with model.parametrization = '{m.parametrization}': {why}. Remove "
                "the key."
            )
