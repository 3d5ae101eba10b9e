"""The model.rope_* keys over Llama 3's args (llama3, moe; deepseek_v3 takes the base): the RoPE base and the Llama
3.1-style scaling, typically changed when a context-extension stage resumes a checkpoint on longer sequences.

Args that are not Llama 3's refuse a set key instead of ignoring it, so that no stage silently trains on the old
frequencies.
"""

import dataclasses

from torchpre.checkpoint.layout import STAGE_KEYS
from torchpre.config.job_config import Model
from torchpre.errors import ConfigError
from torchpre.models.args import ModelArgs
from torchpre.models.llama3.args import RopeScaling, TransformerArgs

# Meta's Llama 3.1 values, for scaling turned on over a flavor that has none.
DEFAULT_LOW_FREQ_FACTOR, DEFAULT_HIGH_FREQ_FACTOR = 1.0, 4.0


# The model.rope_* keys, which are also the names a checkpoint records them under.
ROPE_KEYS = tuple(key for key in STAGE_KEYS if key.startswith("rope_"))


def with_rope(args: ModelArgs, m: Model, where: str) -> ModelArgs:
    """`args` (a flavor's, which `where` names) with model.rope_theta and the Llama 3.1 scaling keys of `m` set; a
    ConfigError naming the key for args that have no RoPE to set, or for values that make no frequencies."""
    if not isinstance(args, TransformerArgs):
        for key in ROPE_KEYS:
            if value := getattr(m, key):
                raise ConfigError(
                    f"model.{key} = {value} with {where}: this family does not read it (its args are not Llama 3's: "
                    "model.rope_* set the RoPE of llama3 and moe). Remove the key (0 = unset)."
                )
        return args
    theta = m.rope_theta or args.rope_theta
    return dataclasses.replace(args, rope_theta=theta, rope_scaling=_scaling(m, args.rope_scaling, where))


def _scaling(m: Model, flavor: RopeScaling | None, where: str) -> RopeScaling | None:
    """The scaling the keys describe over the flavor's `flavor`: None when off (a factor of 1, or 0 over a flavor
    without scaling)."""
    asked = m.rope_scaling_factor
    factor = asked or (flavor.factor if flavor else 1.0)
    details = {
        "rope_low_freq_factor": m.rope_low_freq_factor,
        "rope_high_freq_factor": m.rope_high_freq_factor,
        "rope_original_max_seq_len": m.rope_original_max_seq_len,
    }
    if factor == 1:
        set_keys = [key for key, value in details.items() if value]
        if set_keys:
            raise ConfigError(
                f"model.{set_keys[0]} = {details[set_keys[0]]} shapes Llama 3.1 RoPE scaling, which is off "
                f"(model.rope_scaling_factor = {asked}): set rope_scaling_factor above 1, or remove the key."
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
            f"model.rope_scaling_factor = {factor} turns on RoPE scaling over {where}, which has none, so "
            "model.rope_original_max_seq_len must say which context the unscaled frequencies were trained on (e.g. "
            "the previous stage's training.seq_len)."
        )
    return RopeScaling(factor, low, high, original)
