"""The one line a resume under another layout logs: from which layout to which, why, and at which step.

An elastic job (`torchrun --nnodes MIN:MAX`) that loses or gains a node resumes its latest checkpoint on another
world size, with dp absorbing the change and gradient accumulation keeping the global batch; a user may also resume
under other parallelism.* degrees on purpose. Either way the log says so once, with its time stamp, instead of
leaving the reader to diff two "layout" lines. The saving layout is the checkpoint's `LAYOUT_KEYS`.
"""

import os
from pathlib import Path

# The layout of the job that saved a checkpoint (entries of its "train" state): how many ranks, the degrees and the
# microbatches per optimizer step. They describe the run, not its state: a resume under another layout compares
# them, it loads nothing into them.
LAYOUT_KEYS = ("world_size", "dp", "tp", "pp", "ep", "cp", "accumulation_steps")
# What the saving job trained on, beside its layout, by the config key that sets it: a resume that changes it
# starts a new stage of the run. The rope_* entries are the resolved RoPE (`torchpre.assembly.rope.rope_record`).
STAGE_KEYS = {
    "seq_len": "training.seq_len",
    "rope_theta": "model.rope_theta",
    "rope_scaling_factor": "model.rope_scaling_factor",
    "rope_low_freq_factor": "model.rope_low_freq_factor",
    "rope_high_freq_factor": "model.rope_high_freq_factor",
    "rope_original_max_seq_len": "model.rope_original_max_seq_len",
}


def describe_layout(layout: dict[str, int]) -> str:
    """The layout in words, e.g. "2 ranks as dp 2 x tp 1 x pp 1 (ep 1), 1 microbatch per step"; the world size
    alone for a checkpoint saved before the degrees were recorded."""
    ranks = f"{layout['world_size']} rank{'s' if layout['world_size'] != 1 else ''}"
    if "dp" not in layout:
        return f"{ranks} (degrees not recorded)"
    microbatches = layout["accumulation_steps"]
    cp = f" x cp {layout['cp']}" if layout.get("cp", 1) > 1 else ""
    return (
        f"{ranks} as dp {layout['dp']} x tp {layout['tp']} x pp {layout['pp']}{cp} (ep {layout['ep']}), "
        f"{microbatches} microbatch{'es' if microbatches != 1 else ''} per step"
    )


def layout_change(
    saved: dict[str, int], current: dict[str, int], step_dir: Path, step: int, global_batch_size: int
) -> str | None:
    """The line to log when `saved` (the layout keys of the checkpoint `step_dir` of train step `step`; may lack
    some) differs from `current` (all of them), else None."""
    known = [key for key in LAYOUT_KEYS if key in saved]
    if not known or all(saved[key] == current[key] for key in known):
        return None
    if saved["world_size"] != current["world_size"]:
        why = f"the world size changed from {saved['world_size']} to {current['world_size']}{_torchrun_round()}"
    elif any(saved[key] != current[key] for key in ("dp", "tp", "pp", "ep", "cp") if key in saved):
        why = "the parallelism.* degrees changed on the same world size"
    else:
        why = "training.local_batch_size or training.global_batch_size changed the microbatches per step"
    return (
        f"layout changed: {step_dir} was saved by {describe_layout(saved)}; this job runs "
        f"{describe_layout(current)} (global batch {global_batch_size}), because {why}. Resuming at step {step}."
    )


def _torchrun_round() -> str:
    """Under torchrun, e.g. " (torchrun's rendezvous round: 1 node, restart count 1; a node left or joined)"; else
    ""."""
    nodes = os.environ.get("GROUP_WORLD_SIZE")
    if "TORCHELASTIC_RUN_ID" not in os.environ or nodes is None:
        return ""
    restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    plural = "s" if nodes != "1" else ""
    return f" (torchrun's rendezvous round: {nodes} node{plural}, restart count {restarts}; a node left or joined)"


def stage_change(
    saved: dict[str, float], current: dict[str, float], global_batch_size: int, step: int, batch_unit: str
) -> str | None:
    """The line to log when a resume at train step `step` changes a `STAGE_KEYS` value from the checkpoint's
    (`saved`; a key it lacks was not recorded) to this job's (`current`): which, what kind of stage (a longer
    training.seq_len is a context extension), and what it keeps of the global batch (training.global_batch_unit
    `batch_unit`); else None."""
    changed = [key for key in STAGE_KEYS if key in saved and key in current and saved[key] != current[key]]
    if not changed:
        return None
    changes = ", ".join(f"{STAGE_KEYS[k]} {_value(k, saved[k])} -> {_value(k, current[k])}" for k in changed)
    old_len, seq_len = int(saved.get("seq_len", current["seq_len"])), int(current["seq_len"])
    kind = "context extension" if seq_len > old_len else "shorter sequences" if seq_len < old_len else "new RoPE"
    line = f"stage change at step {step}: {changes} ({kind})."
    if seq_len == old_len:
        return line
    return (
        f"{line} RoPE is computed for {seq_len} positions; the data position is kept in sequences (the next ones are "
        f"{seq_len + 1}-token windows of the same data, in their own seeded order); the global batch is "
        f"{global_batch_size} sequences = {global_batch_size * seq_len} tokens per step "
        f"({_batch_kept(global_batch_size, old_len, seq_len, batch_unit)})."
    )


def _value(key: str, value: float) -> str:
    """A stage value as a user writes it: 500000 rather than 500000.0, "off" for a scaling key of no scaling."""
    if key.startswith("rope_") and key != "rope_theta" and value == 0:
        return "off"
    return str(int(value)) if float(value).is_integer() else str(value)


def _batch_kept(global_batch_size: int, old_len: int, seq_len: int, batch_unit: str) -> str:
    """What the global batch keeps across a change of sequence length, and how to keep the other quantity."""
    if batch_unit == "tokens":
        return "training.global_batch_unit = 'tokens' kept the checkpoint's tokens per step"
    kept_tokens = global_batch_size * old_len
    if kept_tokens % seq_len:
        return f"a global batch of {kept_tokens} tokens is no whole number of {seq_len}-token sequences"
    return (
        f"kept in sequences; set training.global_batch_unit = 'tokens' to keep {kept_tokens} tokens per step as "
        f"{kept_tokens // seq_len} sequences"
    )
