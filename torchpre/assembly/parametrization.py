"""The model's shape and parametrization away from the [model] step: the job's shape keys applied to a flavor for the
planner's shortened copies (`with_model_shape`, after `model_args` checked them), and the optimizer's per-parameter
factors of the parametrized model.
"""

from collections.abc import Sequence

from torchpre.config.job_config import Model
from torchpre.models.args import ModelArgs
from torchpre.models.shapes import SHAPE_KEYS, with_shape
from torchpre.optim.param_scales import ParamScales
from torchpre.optim.registry import get_optimizer


def with_model_shape(m: Model, args: ModelArgs, **base: int) -> ModelArgs:
    """The flavor's `args` with the model.* shape keys (`base` replaces some of them: the base shape of a
    parametrization)."""
    shape = {key: getattr(m, key) for key in SHAPE_KEYS} | base
    return with_shape(args, **shape)


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
