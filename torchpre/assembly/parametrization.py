"""The model's shape and parametrization from the job config, applied once to the flavor's args (`model_args`):
model.dim, model.n_layers, model.n_heads and model.n_kv_heads on top of the flavor (torchpre.models.shapes), then
model.parametrization with its base shape (torchpre.models.parametrization). Where one cannot apply, it is refused by
name before any work.
"""

from collections.abc import Callable, Sequence

from torchpre.config.job_config import JobConfig, Model
from torchpre.errors import ConfigError
from torchpre.models.args import ModelArgs
from torchpre.models.parametrization import Settings, parametrize
from torchpre.models.registry import ModelSpec
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


def with_parametrization(
    config: JobConfig,
    spec: ModelSpec,
    args: ModelArgs,
    flavor: ModelArgs | None,
    base_at: Callable[[int, int], ModelArgs | None],
) -> ModelArgs:
    """`args` (the job's model) with model.parametrization relative to the base model `base_at(dim, depth)` builds:
    model.mup_base_dim (default: the flavor's dim) and, under complete_p, model.mup_base_depth (default: the flavor's
    n_layers; µP keeps the model's own depth)."""
    m = config.model
    if m.parametrization == "sp":
        _refuse_set(m, MUP_KEYS, "they apply under model.parametrization = 'mup' or 'complete_p'")
        return args
    if m.parametrization == "mup":
        _refuse_set(m, ("mup_base_depth",), "the base depth is read by model.parametrization = 'complete_p' only")
    check_parametrization(config, args)
    for key in ("mup_base_dim", "mup_base_depth", "mup_base_head_dim"):
        if getattr(m, key) < 0:
            raise ConfigError(f"model.{key} = {getattr(m, key)}: it must be positive (0 = the default).")
    for key in ("mup_embedding_multiplier", "mup_logit_multiplier"):
        if not getattr(m, key) > 0:
            raise ConfigError(f"model.{key} = {getattr(m, key)}: a multiplier must be positive.")
    dim = m.mup_base_dim or flavor.dim
    depth = (m.mup_base_depth or flavor.n_layers) if m.parametrization == "complete_p" else args.n_layers
    try:
        base = base_at(dim, depth)
    except ConfigError as error:
        shape = f"model.mup_base_dim = {dim}, depth {depth}"
        raise ConfigError(f"The base model ({shape}) does not hold: {error}") from None
    settings = Settings(m.parametrization, m.mup_base_head_dim, m.mup_embedding_multiplier, m.mup_logit_multiplier)
    return parametrize(spec.build.model_cls, args, base, settings)


def check_parametrization(config: JobConfig, args: ModelArgs) -> None:
    """Refuses model.parametrization where it cannot apply: a family without the multipliers in its forward, an
    optimizer without a stated rule. (A Hugging Face folder's weights are refused where they load: `hf_weights`.)"""
    m, key = config.model, f"model.parametrization = '{config.model.parametrization}'"
    if not args.parametrized:
        raise ConfigError(
            f"{key} with model.name = '{m.name}': this family's forward has no multipliers to set (µP needs the "
            "attention scale 1/d, the logit and embedding multipliers and, for complete_p, the residual ones). Use "
            "llama3, moe or deepseek_v3, or model.parametrization = 'sp'."
        )
    spec = get_optimizer(config.optimizer.name)
    if spec.mup_update is None:
        raise ConfigError(
            f"{key} with optimizer.name = '{config.optimizer.name}': torchpre has no per-parameter rule for it. "
            "Muon's would be spectral scaling (each matrix's update scaled by sqrt(fan-out / fan-in), "
            "optimizer.muon_lr_adjust = 'spectral_unclamped', no 1/width on its learning rate), which the "
            "learning-rate transfer test has not checked. Use AdamW, Adam, SGD, Adagrad or RMSprop."
        )


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
