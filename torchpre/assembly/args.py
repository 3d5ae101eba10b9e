"""The [model] section's resolve step: the job's model args, built one way for training, validation, generation,
conversion and the planner.

`model_args` reads the model.* keys first (`model_keys`: each against the others, as plain values), then looks the
family's args up and applies the keys to them: the flavor's (or a Hugging Face folder's) args, the shape, RoPE and
multi-token prediction keys, the vocabulary and sequence length, then the parametrization relative to the same model at
its base shape. Each key is checked here against the args it applies to, before any work; the code that applies it
(`torchpre.models.shapes`, `torchpre.models.llama3.rope_keys`) trusts it. A second copy of any of these steps is how
generation and training drifted apart.
"""

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from torchpre.config.job_config import JobConfig, Model
from torchpre.data.tokenizer import Tokenizer
from torchpre.errors import ConfigError, resolve_step
from torchpre.interchange.load import FROM_HF, folder_args
from torchpre.interchange.reader import is_hf_folder
from torchpre.models.args import ModelArgs
from torchpre.models.llama3.args import TransformerArgs
from torchpre.models.llama3.rope_keys import ROPE_KEYS, SCALING_DETAIL_KEYS, asked_scaling, with_rope
from torchpre.models.parametrization import Settings, parametrize
from torchpre.models.registry import ModelSpec, get_model_spec, suggest_name
from torchpre.models.shapes import SHAPE_KEYS, with_shape
from torchpre.optim.registry import get_optimizer

MUP_KEYS = ("mup_base_dim", "mup_base_depth", "mup_base_head_dim", "mup_embedding_multiplier", "mup_logit_multiplier")
_DEFAULTS = Model()


@dataclass(frozen=True)
class ModelKeys:
    """What the model.* keys ask of the model: its vocabulary (model.vocab_size or the tokenizer's; 0 for a Hugging
    Face folder's, which the folder sets), its shape (model.dim, n_layers, n_heads, n_kv_heads; 0: the flavor's), its
    multi-token prediction, its parametrization (None: the standard one) and that parametrization's base
    width and depth (0: the flavor's)."""

    vocabulary: int
    shape: dict[str, int]
    mtp_depth: int
    mtp_loss_weight: float
    parametrization: Settings | None
    base_dim: int
    base_depth: int


@resolve_step
def model_args(config: JobConfig, tokenizer: Tokenizer, max_seq_len: int | None = None) -> ModelArgs:
    """The flavor's args (model.flavor = 'from_hf': the folder's at checkpoint.initial_load_path) with the job's
    shape (model.dim, n_layers, n_heads, n_kv_heads), vocabulary, `max_seq_len` (default: training.seq_len), RoPE
    (model.rope_*), multi-token prediction (model.mtp_*) and parametrization (model.parametrization, relative to the
    same model at its base shape); a family with `args_from_job` (model.name = 'hf') builds its own."""
    seq_len = config.training.seq_len if max_seq_len is None else max_seq_len
    spec = get_model_spec(config.model.name)
    keys = model_keys(config, tokenizer, own_config=spec.args_from_job is not None)
    if spec.args_from_job is None:
        return flavored_args(config, spec, keys, tokenizer, seq_len)
    name, settings = config.model.name, keys.parametrization
    args = spec.args_from_job(config, keys.vocabulary, seq_len)
    if settings is not None:
        _check_parametrized(args, settings, name)
        raise ConfigError(
            f"model.parametrization = '{settings.name}' with model.name = '{name}': its args come from its own config "
            "(ModelSpec.args_from_job), with no flavor to take the base shape from. Use model.parametrization = 'sp'."
        )
    return _with_mtp(args, keys.mtp_depth, keys.mtp_loss_weight, name)


def model_keys(config: JobConfig, tokenizer: Tokenizer, own_config: bool) -> ModelKeys:
    """The job's model.* keys, checked on their own before the family's args are looked up: for a family that reads
    its model from its own config (`own_config`: `ModelSpec.args_from_job`, model.name = 'hf') the vocabulary, RoPE
    and shape keys are refused, as the shape keys are for a Hugging Face folder (model.flavor = 'from_hf')."""
    m = config.model
    settings = _parametrization_settings(m)
    if own_config:
        _refuse_own_config_keys(m)
    from_hf = m.flavor == FROM_HF
    if from_hf:
        _refuse_shape_keys(m, f"model.flavor = '{FROM_HF}' takes the shape of the folder's config.json")
    return ModelKeys(
        vocabulary=0 if from_hf else vocab_size(config, tokenizer),
        shape={key: getattr(m, key) for key in SHAPE_KEYS},
        mtp_depth=m.mtp_depth,
        mtp_loss_weight=m.mtp_loss_weight,
        parametrization=settings,
        base_dim=m.mup_base_dim,
        base_depth=m.mup_base_depth,
    )


def flavored_args(config: JobConfig, spec: ModelSpec, keys: ModelKeys, tokenizer: Tokenizer, seq_len: int) -> ModelArgs:
    """The args of model.flavor (`flavor_args`) with the job's `keys` applied, parametrized relative to the same model
    at the base shape."""
    m, flavor = config.model, flavor_args(config)
    where = f"model.name = '{m.name}', model.flavor = '{m.flavor}'"
    vocabulary = keys.vocabulary
    if m.flavor == FROM_HF:
        folder = config.checkpoint.initial_load_path
        vocabulary = _released_vocabulary(tokenizer, flavor.vocab_size, m.vocab_size, where, folder)

    def at_shape(**base: int) -> ModelArgs:
        shape = keys.shape | base
        _check_shape_keys(flavor, shape, where)
        try:
            shaped = with_shape(flavor, **shape)
        except ConfigError as error:  # the family's args refuse the shape (their step, `__post_init__`)
            settings = ", ".join(f"model.{key} = {value}" for key, value in shape.items() if value)
            raise ConfigError(f"{settings} on {where}: {error}. Choose a shape that holds together.") from None
        _check_rope_keys(shaped, m, where)
        args = _with_mtp(with_rope(shaped, m, where), keys.mtp_depth, keys.mtp_loss_weight, m.name)
        args = _with_mlp(args, config, where)
        return dataclasses.replace(args, vocab_size=vocabulary, max_seq_len=seq_len)

    args, settings = at_shape(), keys.parametrization
    if settings is None:
        return args
    _check_parametrized(args, settings, m.name)
    _check_mup_rule(config.optimizer.name, settings.name)
    dim = keys.base_dim or flavor.dim
    depth = (keys.base_depth or flavor.n_layers) if settings.name == "complete_p" else args.n_layers
    try:
        base = at_shape(dim=dim, n_layers=depth)
    except ConfigError as error:
        shape = f"model.mup_base_dim = {dim}, depth {depth}"
        raise ConfigError(f"The base model ({shape}) does not hold: {error}") from None
    return parametrize(spec.build.model_cls, args, base, settings)


def flavor_args(config: JobConfig) -> ModelArgs:
    """The args model.flavor names: a registered flavor's, or with 'from_hf' those of checkpoint.initial_load_path's
    config.json."""
    if config.model.flavor == FROM_HF:
        path = Path(config.checkpoint.initial_load_path)
        if not config.checkpoint.initial_load_path or not is_hf_folder(path):
            given = f"'{path}', which is not one" if config.checkpoint.initial_load_path else "unset"
            raise ConfigError(
                f"model.flavor = '{FROM_HF}' reads the model from the Hugging Face folder at "
                f"checkpoint.initial_load_path (config.json and safetensors weights), which is {given}. Set "
                "checkpoint.initial_load_path to the folder."
            )
        return folder_args(path, get_model_spec(config.model.name), config.model.name)
    m, flavors = config.model, get_model_spec(config.model.name).flavors
    if m.flavor not in flavors:
        suggestion = suggest_name(m.flavor, flavors)
        raise ConfigError(f"model.flavor = '{m.flavor}' is not a flavor of '{m.name}'.{suggestion}")
    return flavors[m.flavor]


def folder_vocab_size(config: JobConfig, tokenizer: Tokenizer, args: ModelArgs) -> int:
    """The folder's vocabulary (its embedding's rows), which the tokenizer's ids must fit and model.vocab_size may
    only repeat; the shape keys are refused, as the folder's config.json sets the shape."""
    _refuse_shape_keys(config.model, f"model.flavor = '{FROM_HF}' takes the shape of the folder's config.json")
    setting, folder = f"model.flavor = '{FROM_HF}'", config.checkpoint.initial_load_path
    return _released_vocabulary(tokenizer, args.vocab_size, config.model.vocab_size, setting, folder)


def model_context(config: JobConfig, tokenizer: Tokenizer) -> int:
    """The longest sequence the model is designed for: its flavor's max_seq_len, or the model's own context."""
    spec = get_model_spec(config.model.name)
    if spec.args_from_job is not None:
        return spec.args_from_job(config, vocab_size(config, tokenizer), None).max_seq_len
    return flavor_args(config).max_seq_len


def _with_mtp(args: ModelArgs, depth: int, loss_weight: float, family: str) -> ModelArgs:
    """`args` with model.mtp_depth = `depth` and model.mtp_loss_weight = `loss_weight`, for a family with multi-token
    prediction (`predicts_ahead`); a ConfigError for a depth asked of `family` that has none."""
    if args.predicts_ahead:
        return dataclasses.replace(args, mtp_depth=depth, mtp_loss_weight=loss_weight)
    if depth:
        raise ConfigError(
            f"model.mtp_depth = {depth} with model.name = '{family}': multi-token prediction is built for "
            "model.name = 'deepseek_v3'. Set model.mtp_depth = 0."
        )
    return args


def _with_mlp(args: ModelArgs, config: JobConfig, where: str) -> ModelArgs:
    """`args` (of `where`) with model.mlp's feed-forward (empty: the flavor's), for a family whose blocks take the
    choice (`selectable_mlp`); refused for the others and for a job that reads or writes Hugging Face Llama weights."""
    mlp = config.model.mlp
    if not mlp:
        return args
    if not args.selectable_mlp:
        raise ConfigError(
            f"model.mlp = '{mlp}' with {where}: this family's feed-forward is its own (moe's and deepseek_v3's "
            "experts and dense blocks are SwiGLU); model.mlp chooses the MLP of model.name = 'llama3'. Remove the key."
        )
    args = dataclasses.replace(args, mlp=mlp)
    if uses := _hf_weights_use(config):
        check_hf_mlp(args, uses)
    return args


def _hf_weights_use(config: JobConfig) -> str:
    """The key through which the job reads or writes a Hugging Face folder's weights ("" when none does)."""
    load_path = config.checkpoint.initial_load_path
    if config.model.flavor == FROM_HF:
        return f"model.flavor = '{FROM_HF}'"
    if load_path and is_hf_folder(Path(load_path)):
        return f"checkpoint.initial_load_path = '{load_path}' (a Hugging Face folder)"
    return "hf_export.enable = true" if config.hf_export.enable else ""


def check_hf_mlp(args: ModelArgs, uses: str) -> None:
    """Refuses a non-gated MLP for `uses`, which reads or writes a Hugging Face Llama folder: its config describes
    only Llama's gated MLP (gate_proj, up_proj, down_proj), so a GELU model has no folder to come from or go to."""
    if isinstance(args, TransformerArgs) and not args.gated_mlp:
        raise ConfigError(
            f"model.mlp = '{args.mlp}' with {uses}: a Hugging Face Llama folder has only Llama's gated MLP "
            "(LlamaConfig has no non-gated one), so a GELU model cannot be read from or written to one. Keep the model "
            "in torchpre's checkpoints (checkpoint.*), or set model.mlp = 'swiglu'."
        )


def _released_vocabulary(tokenizer: Tokenizer, rows: int, asked: int, setting: str, folder: str) -> int:
    """The vocabulary of a released model whose embedding in `folder` has `rows` rows, which `setting` (the key that
    reads it) trains: model.vocab_size (`asked`; 0 = unset) may only repeat it, and the tokenizer's ids must each
    have a row."""
    if asked not in (0, rows):
        raise ConfigError(
            f"model.vocab_size = {asked} with {setting}: the folder's embedding has vocab_size = {rows} rows. Set "
            "model.vocab_size = 0."
        )
    if tokenizer.vocab_size > rows:
        raise ConfigError(
            f"The tokenizer {tokenizer.path} (model.tokenizer_path) has {tokenizer.vocab_size} ids, more than the "
            f"{rows} rows of the embedding of {folder}. Use the tokenizer the model was released with."
        )
    return rows


def _check_parametrized(args: ModelArgs, settings: Settings, family: str) -> None:
    """Refuses `settings` for a family whose forward has no multipliers to set (`ModelArgs.parametrized`)."""
    if not args.parametrized:
        raise ConfigError(
            f"model.parametrization = '{settings.name}' with model.name = '{family}': this family's forward has no "
            "multipliers to set (µP needs the attention scale 1/d, the logit and embedding multipliers and, for "
            "complete_p, the residual ones). Use llama3, moe or deepseek_v3, or model.parametrization = 'sp'."
        )


def _check_mup_rule(name: str, parametrization: str) -> None:
    """Refuses model.parametrization = `parametrization` (not 'sp') with an optimizer that has no stated per-parameter
    rule (`OptimizerSpec.mup_update`)."""
    if get_optimizer(name).mup_update is None:
        raise ConfigError(
            f"model.parametrization = '{parametrization}' with optimizer.name = '{name}': torchpre has no "
            "per-parameter rule for it. Muon's would be spectral scaling (each matrix's update scaled by "
            "sqrt(fan-out / fan-in), optimizer.muon_lr_adjust = 'spectral_unclamped', no 1/width on its learning "
            "rate), which the learning-rate transfer test has not checked. Use AdamW, Adam, SGD, Adagrad or RMSprop."
        )


def vocab_size(config: JobConfig, tokenizer: Tokenizer) -> int:
    """model.vocab_size, or the tokenizer's when it is 0. A vocabulary smaller than the tokenizer's is only for
    random tokens: text would hold ids the embedding has no row for."""
    size = config.model.vocab_size or tokenizer.vocab_size
    texts = [f"{section}.dataset = '{name}'" for section, name in _datasets(config) if name != "synthetic"]
    if size < tokenizer.vocab_size and texts:
        raise ConfigError(
            f"model.vocab_size = {size} is smaller than the tokenizer's {tokenizer.vocab_size} ids "
            f"({tokenizer.path}, model.tokenizer_path), which {texts[0]} holds. Set model.vocab_size = 0 (the "
            f"tokenizer's) or at least {tokenizer.vocab_size}, or train on training.dataset = 'synthetic'."
        )
    return size


def _datasets(config: JobConfig) -> list[tuple[str, str]]:
    """(section, dataset) of every source the job reads tokens from."""
    v = config.validation
    return [("training", config.training.dataset)] + ([("validation", v.dataset)] if v.enable and v.dataset else [])


def _parametrization_settings(m: Model) -> Settings | None:
    """What model.parametrization and the model.mup_* keys set (None: the standard parametrization, under which the
    mup keys are refused); whether the family and the optimizer can take it is checked once the args are known."""
    if m.parametrization == "sp":
        _refuse_changed(m, MUP_KEYS, "they apply under model.parametrization = 'mup' or 'complete_p'")
        return None
    if m.parametrization == "mup":
        _refuse_changed(m, ("mup_base_depth",), "the base depth is read by model.parametrization = 'complete_p' only")
    return Settings(m.parametrization, m.mup_base_head_dim, m.mup_embedding_multiplier, m.mup_logit_multiplier)


def _refuse_changed(m: Model, keys: tuple[str, ...], why: str) -> None:
    """A ConfigError naming the first of `keys` changed from its default, which model.parametrization does not read."""
    for key in keys:
        if getattr(m, key) != getattr(_DEFAULTS, key):
            raise ConfigError(
                f"model.{key} = {getattr(m, key)} with model.parametrization = '{m.parametrization}': {why}. Remove "
                "the key."
            )


def _refuse_own_config_keys(m: Model) -> None:
    """Refuses the keys a family that reads its model from its own config (model.hf_config) would ignore."""
    if m.mlp:
        raise ConfigError(
            f"model.mlp = '{m.mlp}' with model.name = '{m.name}': this family's MLP comes from its own config "
            "(model.hf_config's hidden_act and architecture: set it there). Remove the key."
        )
    if m.vocab_size:
        raise ConfigError(
            f"model.vocab_size = {m.vocab_size} with model.name = '{m.name}': this family takes its vocabulary "
            "from its own config (model.hf_config's vocab_size). Set model.vocab_size = 0."
        )
    if first := _first_set(m, ROPE_KEYS):
        key, value = first
        raise ConfigError(
            f"model.{key} = {value} with model.name = '{m.name}': this family does not read it (its RoPE comes from "
            "its own config, model.hf_config: set it there). Remove the key (0 = unset)."
        )
    _refuse_shape_keys(m, f"model.name = '{m.name}' takes its shape from model.hf_config: set it there")


def _refuse_shape_keys(m: Model, why: str) -> None:
    """A ConfigError naming the first shape key that is set, for a model whose shape comes from elsewhere."""
    if first := _first_set(m, SHAPE_KEYS):
        key, value = first
        raise ConfigError(f"model.{key} = {value}: {why}. Remove the key (0 = unset).")


def _check_shape_keys(args: ModelArgs, shape: dict[str, int], where: str) -> None:
    """Refuses a shape key (0 = the flavor's) that the args of `where` (e.g. "model.flavor = 'tiny'") do not take,
    and a model.dim that does not scale each width following it (`width_fields`) to a whole number."""
    given = {key: value for key, value in shape.items() if value}
    taken = type(args).shape_keys
    refused = [key for key in given if key not in taken]
    if refused:
        takes = f"it takes model.{', model.'.join(taken)}" if taken else "its args take no shape keys"
        raise ConfigError(
            f"model.{refused[0]} = {given[refused[0]]} with {where}: {takes}. Remove the key (0 = the flavor's)."
        )
    dim = given.get("dim")
    for name in type(args).width_fields if dim else ():
        width = getattr(args, name)
        if width * dim % args.dim:
            raise ConfigError(
                f"model.dim = {dim} on {where}: its {name} ({width} at dim {args.dim}) follows the width, and "
                f"{width} x {dim} / {args.dim} is not a whole number. Use a dim that scales it exactly (a multiple of "
                f"{args.dim // math.gcd(width, args.dim)})."
            )


def _check_rope_keys(args: ModelArgs, m: Model, where: str) -> None:
    """Refuses a model.rope_* key for args (of `where`) that are not Llama 3's, a scaling key while the scaling is
    off, and scaling keys that make no frequencies, so that no stage silently trains on the old frequencies."""
    if not isinstance(args, TransformerArgs):
        if first := _first_set(m, ROPE_KEYS):
            key, value = first
            raise ConfigError(
                f"model.{key} = {value} with {where}: this family does not read it (its args are not Llama 3's: "
                "model.rope_* set the RoPE of llama3 and moe). Remove the key (0 = unset)."
            )
        return
    scaling = asked_scaling(m, args.rope_scaling)
    if scaling.factor == 1:
        if first := _first_set(m, SCALING_DETAIL_KEYS):
            key, value = first
            raise ConfigError(
                f"model.{key} = {value} shapes Llama 3.1 RoPE scaling, which is off "
                f"(model.rope_scaling_factor = {m.rope_scaling_factor}): set rope_scaling_factor above 1, or remove "
                "the key."
            )
        return
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    if not 0 < low < high:
        raise ConfigError(
            f"model.rope_low_freq_factor = {low} and model.rope_high_freq_factor = {high}: Llama 3.1 scaling needs "
            "0 < low < high (Llama 3.1: 1 and 4)."
        )
    if scaling.original_max_position_embeddings <= 0:
        raise ConfigError(
            f"model.rope_scaling_factor = {scaling.factor} turns on RoPE scaling over {where}, which has none, so "
            "model.rope_original_max_seq_len must say which context the unscaled frequencies were trained on (e.g. "
            "the previous stage's training.seq_len)."
        )


def _first_set(m: Model, keys: tuple[str, ...]) -> tuple[str, object] | None:
    """(key, value) of the first of `keys` that `m` sets (not 0), or None."""
    return next(((key, getattr(m, key)) for key in keys if getattr(m, key)), None)
