"""RoPE from the config: the model.rope_* keys override the base and the Llama 3.1-style scaling of a family built on
Llama 3's args (llama3, moe), typically when a context-extension stage resumes a checkpoint on longer sequences.

A family that reads its RoPE elsewhere (model.name = 'hf': its config.json) refuses a set key instead of ignoring it,
so that no stage silently trains on the old frequencies. What a job trains with is recorded in its checkpoints
(`rope_record`), so a resume that changes it says so (`torchpre.checkpoint.layout.stage_change`).
"""

import dataclasses
from pathlib import Path

from torchpre.checkpoint.integrity import Trust
from torchpre.checkpoint.layout import STAGE_KEYS
from torchpre.checkpoint.state import read_train_values
from torchpre.config.job_config import Model
from torchpre.errors import ConfigError
from torchpre.models.args import ModelArgs
from torchpre.models.llama3.args import RopeScaling, TransformerArgs

# Meta's Llama 3.1 values, for scaling turned on over a flavor that has none.
DEFAULT_LOW_FREQ_FACTOR, DEFAULT_HIGH_FREQ_FACTOR = 1.0, 4.0
# The model.rope_* keys, which are also the names a checkpoint records them under.
ROPE_KEYS = tuple(key for key in STAGE_KEYS if key.startswith("rope_"))


def with_rope(m: Model, args: ModelArgs) -> ModelArgs:
    """`args` (a flavor's) with model.rope_theta and the Llama 3.1 scaling keys applied; a ConfigError naming the
    key for args that have no RoPE to set, or for values that make no frequencies."""
    if not isinstance(args, TransformerArgs):
        refuse_rope_keys(m, "its args are not Llama 3's (model.rope_* set the RoPE of llama3 and moe)")
        return args
    if m.rope_theta < 0:
        raise ConfigError(f"model.rope_theta = {m.rope_theta}: the RoPE base must be positive (0 = the flavor's).")
    theta = m.rope_theta or args.rope_theta
    return dataclasses.replace(args, rope_theta=theta, rope_scaling=_scaling(m, args.rope_scaling))


def refuse_rope_keys(m: Model, why: str) -> None:
    """A ConfigError naming the first model.rope_* key that is set (not 0), for a family that does not read it."""
    for key in ROPE_KEYS:
        if getattr(m, key):
            raise ConfigError(
                f"model.{key} = {getattr(m, key)} with model.name = '{m.name}': this family does not read it "
                f"({why}). Remove the key (0 = unset)."
            )


def _scaling(m: Model, flavor: RopeScaling | None) -> RopeScaling | None:
    """The scaling the keys describe over the flavor's `flavor`: None when off (a factor of 1, or 0 over a flavor
    without scaling)."""
    factor = m.rope_scaling_factor or (flavor.factor if flavor else 1.0)
    details = {
        "rope_low_freq_factor": m.rope_low_freq_factor,
        "rope_high_freq_factor": m.rope_high_freq_factor,
        "rope_original_max_seq_len": m.rope_original_max_seq_len,
    }
    if m.rope_scaling_factor and m.rope_scaling_factor < 1:
        raise ConfigError(
            f"model.rope_scaling_factor = {m.rope_scaling_factor}: it divides the long-wavelength frequencies, so it "
            "must be at least 1 (1 = no scaling, 0 = the flavor's)."
        )
    if factor == 1:
        set_keys = [key for key, value in details.items() if value]
        if set_keys:
            raise ConfigError(
                f"model.{set_keys[0]} = {details[set_keys[0]]} shapes Llama 3.1 RoPE scaling, which is off "
                f"(model.rope_scaling_factor = {m.rope_scaling_factor}): set rope_scaling_factor above 1, or remove "
                "the key."
            )
        return None
    low = m.rope_low_freq_factor or (flavor.low_freq_factor if flavor else DEFAULT_LOW_FREQ_FACTOR)
    high = m.rope_high_freq_factor or (flavor.high_freq_factor if flavor else DEFAULT_HIGH_FREQ_FACTOR)
    original = m.rope_original_max_seq_len or (flavor.original_max_position_embeddings if flavor else 0)
    if not 0 < low < high:
        raise ConfigError(
            f"model.rope_low_freq_factor = {low} and model.rope_high_freq_factor = {high}: Llama 3.1 scaling needs "
            "0 < low < high (Llama 3.1: 1 and 4)."
        )
    if original <= 0:
        raise ConfigError(
            f"model.rope_scaling_factor = {factor} turns on RoPE scaling over model.flavor = '{m.flavor}', which "
            "has none, so model.rope_original_max_seq_len must say which context the unscaled frequencies were "
            "trained on (e.g. the previous stage's training.seq_len)."
        )
    return RopeScaling(factor, low, high, original)


def rope_record(args: ModelArgs) -> dict[str, float]:
    """What a checkpoint records of the RoPE a job trains with (`ROPE_KEYS`; the scaling keys 0 when it is off), so
    a resume can name a change; empty for a family without Llama 3's args."""
    if not isinstance(args, TransformerArgs):
        return {}
    s = args.rope_scaling
    scaling = (s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings) if s else (0,) * 4
    return dict(zip(ROPE_KEYS, (float(args.rope_theta), *map(float, scaling))))


def check_saved_rope(step_dir: Path, args: ModelArgs, trust: Trust, allow_pickle: bool = False) -> None:
    """Generation and export use the RoPE of the config (`args`); a checkpoint trained with another (a context-extension
    stage) would give wrong text or a wrong exported config silently, so it is refused, naming the keys to set."""
    saved = read_train_values(step_dir, ROPE_KEYS, trust, allow_pickle)
    ours = rope_record(args)
    changed = [key for key in ROPE_KEYS if key in saved and key in ours and saved[key] != ours[key]]
    if changed:
        settings = " ".join(f"--model.{key} {_number(saved[key])}" for key in changed)
        found = ", ".join(f"model.{key} = {_number(saved[key])} (this run: {_number(ours[key])})" for key in changed)
        raise ConfigError(f"{step_dir} was trained with {found}. Pass {settings} to use the RoPE it was trained with.")


def _number(value: float) -> str:
    return str(int(value)) if value == int(value) else str(value)
