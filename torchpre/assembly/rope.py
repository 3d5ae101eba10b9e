"""The RoPE a job trains with (the model.rope_* keys, which the [model] step checks and
`torchpre.models.llama3.rope_keys` applies), recorded in its checkpoints (`rope_record`), so that a resume that changes
it says so (`torchpre.checkpoint.layout.stage_change`) and generation or export refuses a checkpoint trained with
another.
"""

from pathlib import Path

from torchpre.checkpoint.integrity import Trust
from torchpre.checkpoint.state import read_train_values
from torchpre.errors import ConfigError
from torchpre.models.args import ModelArgs
from torchpre.models.llama3.args import TransformerArgs
from torchpre.models.llama3.rope_keys import ROPE_KEYS


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
