"""The model.* keys of a job, read and checked on their own before the family's args are looked up: what each key asks
of the model, as plain values that `torchpre.assembly.args.model_args` then applies to the args. A key the family
does not read is refused here by name, before any work.
"""

from dataclasses import dataclass

from torchpre.assembly.parametrization import parametrization_settings, refuse_shape_keys
from torchpre.assembly.rope import refuse_rope_keys
from torchpre.config.job_config import JobConfig, Model
from torchpre.data.tokenizer import Tokenizer
from torchpre.errors import ConfigError
from torchpre.interchange.load import FROM_HF
from torchpre.models.parametrization import Settings
from torchpre.models.shapes import SHAPE_KEYS


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


def model_keys(config: JobConfig, tokenizer: Tokenizer, own_config: bool) -> ModelKeys:
    """The job's model.* keys, checked: for a family that reads its model from its own config (`own_config`:
    `ModelSpec.args_from_job`, model.name = 'hf') the vocabulary, RoPE and shape keys are refused, as the shape keys
    are for a Hugging Face folder (model.flavor = 'from_hf')."""
    m = config.model
    settings = parametrization_settings(m)
    if own_config:
        refuse_own_config_keys(m)
    from_hf = m.flavor == FROM_HF
    if from_hf:
        refuse_shape_keys(m, f"model.flavor = '{FROM_HF}' takes the shape of the folder's config.json")
    return ModelKeys(
        vocabulary=0 if from_hf else vocab_size(config, tokenizer),
        shape={key: getattr(m, key) for key in SHAPE_KEYS},
        mtp_depth=m.mtp_depth,
        mtp_loss_weight=m.mtp_loss_weight,
        parametrization=settings,
        base_dim=m.mup_base_dim,
        base_depth=m.mup_base_depth,
    )


def refuse_own_config_keys(m: Model) -> None:
    """Refuses the keys a family that reads its model from its own config (model.hf_config) would ignore."""
    if m.vocab_size:
        raise ConfigError(
            f"model.vocab_size = {m.vocab_size} with model.name = '{m.name}': this family takes its vocabulary "
            "from its own config (model.hf_config's vocab_size). Set model.vocab_size = 0."
        )
    refuse_rope_keys(m, "its RoPE comes from its own config, model.hf_config: set it there")
    refuse_shape_keys(m, f"model.name = '{m.name}' takes its shape from model.hf_config: set it there")


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
