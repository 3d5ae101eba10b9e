"""The job's model, built one way for training, validation, generation and conversion.

Each entry point derives the model's args from the job config and the tokenizer, checks that the model family
can run the layout (before any process group, so bad input stops every rank with one message), builds the
plain model on the meta device in the parameter dtype, and hands it to `torchpre.parallel.parallelize` with the
`ParallelPlan` made here. A second copy of any of these steps is how generation and training drifted apart.
"""

import dataclasses
from pathlib import Path

from torchpre.assembly.parametrization import refuse_shape_keys, with_model_shape, with_parametrization
from torchpre.assembly.rope import refuse_rope_keys, with_rope
from torchpre.config.job_config import JobConfig, Model
from torchpre.data.tokenizer import Tokenizer
from torchpre.errors import ConfigError
from torchpre.interchange.load import FROM_HF, folder_args
from torchpre.interchange.reader import is_hf_folder
from torchpre.models.args import ModelArgs
from torchpre.models.registry import get_flavor, get_model_spec


def model_args(config: JobConfig, tokenizer: Tokenizer, max_seq_len: int | None = None) -> ModelArgs:
    """The flavor's args (model.flavor = 'from_hf': the folder's at checkpoint.initial_load_path) with the job's
    shape (model.dim, n_layers, n_heads, n_kv_heads), vocabulary (`vocab_size`), `max_seq_len` (default:
    training.seq_len), RoPE (model.rope_*, `with_rope`) and parametrization (model.parametrization, relative to the
    same model at its base shape); a family with `args_from_job` (model.name = 'hf') builds its own."""
    seq_len = config.training.seq_len if max_seq_len is None else max_seq_len
    spec, m = get_model_spec(config.model.name), config.model
    if spec.args_from_job is not None:
        if m.vocab_size:
            raise ConfigError(
                f"model.vocab_size = {m.vocab_size} with model.name = '{m.name}': this family takes its vocabulary "
                "from its own config (model.hf_config's vocab_size). Set model.vocab_size = 0."
            )
        refuse_rope_keys(m, "its RoPE comes from its own config, model.hf_config: set it there")
        refuse_shape_keys(m, f"model.name = '{m.name}' takes its shape from model.hf_config: set it there")
        refuse_mtp_keys(m)
        args = spec.args_from_job(config, vocab_size(config, tokenizer), seq_len)
        return with_parametrization(config, spec, args, None, lambda dim, depth: None)
    flavor = flavor_args(config)
    vocabulary = folder_vocab_size(config, tokenizer, flavor) if _from_hf(config) else vocab_size(config, tokenizer)

    def finished(args: ModelArgs) -> ModelArgs:
        args = with_mtp(m, with_rope(m, args))
        return dataclasses.replace(args, vocab_size=vocabulary, max_seq_len=seq_len)

    def base_at(dim: int, depth: int) -> ModelArgs:
        return finished(with_model_shape(m, flavor, dim=dim, n_layers=depth))

    return with_parametrization(config, spec, finished(with_model_shape(m, flavor)), flavor, base_at)


def flavor_args(config: JobConfig) -> ModelArgs:
    """The args model.flavor names: a registered flavor's, or with 'from_hf' those of checkpoint.initial_load_path's
    config.json."""
    if not _from_hf(config):
        return get_flavor(config.model.name, config.model.flavor)
    path = Path(config.checkpoint.initial_load_path)
    if not config.checkpoint.initial_load_path or not is_hf_folder(path):
        given = f"'{path}', which is not one" if config.checkpoint.initial_load_path else "unset"
        raise ConfigError(
            f"model.flavor = '{FROM_HF}' reads the model from the Hugging Face folder at checkpoint.initial_load_path "
            f"(config.json and safetensors weights), which is {given}. Set checkpoint.initial_load_path to the folder."
        )
    return folder_args(path, get_model_spec(config.model.name), config.model.name)


def folder_vocab_size(config: JobConfig, tokenizer: Tokenizer, args: ModelArgs) -> int:
    """The folder's vocabulary (its embedding's rows), which the tokenizer's ids must fit and model.vocab_size may
    only repeat; the shape keys are refused, as the folder's config.json sets the shape."""
    refuse_shape_keys(config.model, f"model.flavor = '{FROM_HF}' takes the shape of the folder's config.json")
    if config.model.vocab_size not in (0, args.vocab_size):
        raise ConfigError(
            f"model.vocab_size = {config.model.vocab_size} with model.flavor = '{FROM_HF}': the folder's embedding has "
            f"vocab_size = {args.vocab_size} rows. Set model.vocab_size = 0."
        )
    if tokenizer.vocab_size > args.vocab_size:
        raise ConfigError(
            f"The tokenizer {tokenizer.path} (model.tokenizer_path) has {tokenizer.vocab_size} ids, more than the "
            f"{args.vocab_size} rows of the embedding of {config.checkpoint.initial_load_path}. Use the tokenizer the "
            "model was released with."
        )
    return args.vocab_size


def _from_hf(config: JobConfig) -> bool:
    return config.model.flavor == FROM_HF


def with_mtp(m: Model, args: ModelArgs) -> ModelArgs:
    """`args` with model.mtp_depth and model.mtp_loss_weight, for a family with multi-token prediction."""
    if not args.predicts_ahead:
        refuse_mtp_keys(m)
        return args
    return dataclasses.replace(args, mtp_depth=m.mtp_depth, mtp_loss_weight=m.mtp_loss_weight)


def refuse_mtp_keys(m: Model) -> None:
    """A ConfigError for model.mtp_depth set on a family without multi-token prediction."""
    if m.mtp_depth:
        raise ConfigError(
            f"model.mtp_depth = {m.mtp_depth} with model.name = '{m.name}': multi-token prediction is built for "
            "model.name = 'deepseek_v3'. Set model.mtp_depth = 0."
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


def model_context(config: JobConfig, tokenizer: Tokenizer) -> int:
    """The longest sequence the model is designed for: its flavor's max_seq_len, or the model's own context."""
    spec = get_model_spec(config.model.name)
    if spec.args_from_job is not None:
        return spec.args_from_job(config, vocab_size(config, tokenizer), None).max_seq_len
    return flavor_args(config).max_seq_len
