"""The model.rope_* keys over Llama 3's args (llama3, moe; deepseek_v3 takes the base): the RoPE base and the Llama
3.1-style scaling, typically changed when a context-extension stage resumes a checkpoint on longer sequences.

The [model] step (`torchpre.assembly.args.model_args`) refuses a key these args cannot take, and values that make no
frequencies, before any work; `with_rope` applies keys it has checked.
"""

import dataclasses

from torchpre.checkpoint.layout import STAGE_KEYS
from torchpre.config.job_config import Model
from torchpre.models.args import ModelArgs
from torchpre.models.llama3.args import RopeScaling, TransformerArgs

# Meta's Llama 3.1 values, for scaling turned on over a flavor that has none.
DEFAULT_LOW_FREQ_FACTOR, DEFAULT_HIGH_FREQ_FACTOR = 1.0, 4.0


# The model.rope_* keys, which are also the names a checkpoint records them under.
ROPE_KEYS = tuple(key for key in STAGE_KEYS if key.startswith("rope_"))
# The keys that shape the scaling, read only when model.rope_scaling_factor (or the flavor's) turns it on.
SCALING_DETAIL_KEYS = ("rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_seq_len")


def with_rope(args: ModelArgs, m: Model, where: str) -> ModelArgs:
    """`args` (a flavor's, which `where` names) with model.rope_theta and the Llama 3.1 scaling keys of `m` set, as
    the [model] step checked them: args that are not Llama 3's come back as they are."""
    if not isinstance(args, TransformerArgs):
        assert not any(getattr(m, key) for key in ROPE_KEYS), f"model.rope_* set on {where}, which has no such RoPE"
        return args
    theta = m.rope_theta or args.rope_theta
    scaling = asked_scaling(m, args.rope_scaling)
    if scaling.factor == 1:
        return dataclasses.replace(args, rope_theta=theta, rope_scaling=None)
    assert 0 < scaling.low_freq_factor < scaling.high_freq_factor and scaling.original_max_position_embeddings > 0
    return dataclasses.replace(args, rope_theta=theta, rope_scaling=scaling)


def asked_scaling(m: Model, flavor: RopeScaling | None) -> RopeScaling:
    """The scaling the keys of `m` describe over the flavor's `flavor` (each key 0 = the flavor's, or Llama 3.1's
    when the flavor has none); a factor of 1 means off."""
    factor = m.rope_scaling_factor or (flavor.factor if flavor else 1.0)
    low = m.rope_low_freq_factor or (flavor.low_freq_factor if flavor else DEFAULT_LOW_FREQ_FACTOR)
    high = m.rope_high_freq_factor or (flavor.high_freq_factor if flavor else DEFAULT_HIGH_FREQ_FACTOR)
    original = m.rope_original_max_seq_len or (flavor.original_max_position_embeddings if flavor else 0)
    return RopeScaling(factor, low, high, original)
