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
# What the saving job trained on, beside its layout: a resume that changes it starts a new stage of the run.
STAGE_KEYS = ("seq_len",)


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


def stage_change(saved_seq_len: int | None, seq_len: int, global_batch_size: int, step: int) -> str | None:
    """The line to log when a resume at train step `step` changes training.seq_len from the checkpoint's
    `saved_seq_len` (None: not recorded): a context-extension stage, and what it keeps; else None."""
    if saved_seq_len is None or saved_seq_len == seq_len:
        return None
    kind = "context extension" if seq_len > saved_seq_len else "shorter sequences"
    kept_tokens = global_batch_size * saved_seq_len
    same_tokens = (
        f"set training.global_batch_size = {kept_tokens // seq_len} to keep {kept_tokens} tokens per step"
        if kept_tokens % seq_len == 0
        else f"a global batch of {kept_tokens} tokens is no whole number of {seq_len}-token sequences"
    )
    return (
        f"stage change at step {step}: training.seq_len {saved_seq_len} -> {seq_len} ({kind}). RoPE is computed for "
        f"{seq_len} positions; the data position is kept in sequences (the next ones are {seq_len + 1}-token "
        f"windows of the same data, in their own seeded order); the global batch is {global_batch_size} sequences "
        f"= {global_batch_size * seq_len} tokens per step ({same_tokens})."
    )
