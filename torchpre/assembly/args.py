"""The job's model args, built one way for training, validation, generation, conversion and the planner.

`model_args` reads the model.* keys first (`torchpre.assembly.keys`: each checked on its own, as plain values), then
looks the family's args up and applies the keys to them: the flavor's (or a Hugging Face folder's) args, the shape,
RoPE and multi-token prediction keys, the vocabulary and sequence length, then the parametrization relative to the same
model at its base shape. A second copy of any of these steps is how generation and training drifted apart.
"""

import dataclasses
from pathlib import Path

from torchpre.assembly.keys import ModelKeys, model_keys, vocab_size
from torchpre.assembly.parametrization import refuse_shape_keys
from torchpre.config.job_config import JobConfig
from torchpre.data.tokenizer import Tokenizer
from torchpre.errors import ConfigError, resolve_step
from torchpre.interchange.load import FROM_HF, folder_args
from torchpre.interchange.reader import is_hf_folder
from torchpre.models.args import ModelArgs
from torchpre.models.llama3.rope_keys import with_rope
from torchpre.models.parametrization import Settings, parametrize
from torchpre.models.registry import ModelSpec, get_flavor, get_model_spec
from torchpre.models.shapes import with_shape
from torchpre.optim.registry import get_optimizer


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


def flavored_args(config: JobConfig, spec: ModelSpec, keys: ModelKeys, tokenizer: Tokenizer, seq_len: int) -> ModelArgs:
    """The args of model.flavor (`flavor_args`) with the job's `keys` applied, parametrized relative to the same model
    at the base shape."""
    m, flavor = config.model, flavor_args(config)
    where = f"model.name = '{m.name}', model.flavor = '{m.flavor}'"
    vocabulary = keys.vocabulary
    if m.flavor == FROM_HF:
        folder = config.checkpoint.initial_load_path
        vocabulary = _released_vocabulary(tokenizer, flavor.vocab_size, m.vocab_size, where, folder)

    def at_shape(**shape: int) -> ModelArgs:
        shaped = with_rope(with_shape(flavor, where, **keys.shape | shape), m, where)
        args = _with_mtp(shaped, keys.mtp_depth, keys.mtp_loss_weight, m.name)
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
    return get_flavor(config.model.name, config.model.flavor)


def folder_vocab_size(config: JobConfig, tokenizer: Tokenizer, args: ModelArgs) -> int:
    """The folder's vocabulary (its embedding's rows), which the tokenizer's ids must fit and model.vocab_size may
    only repeat; the shape keys are refused, as the folder's config.json sets the shape."""
    refuse_shape_keys(config.model, f"model.flavor = '{FROM_HF}' takes the shape of the folder's config.json")
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
