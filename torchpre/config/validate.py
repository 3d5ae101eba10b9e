"""Value checks that the type system cannot express, run before any expensive work."""

import math
from pathlib import Path

from torchpre.config.job_config import JobConfig
from torchpre.errors import ConfigError


def validate_config(config: JobConfig) -> None:
    """Raises ConfigError naming the first impossible value and what would be valid."""
    t, o, s, m = config.training, config.optimizer, config.lr_scheduler, config.metrics
    _at_least("training.local_batch_size", t.local_batch_size, 1)
    _at_least("training.seq_len", t.seq_len, 1)
    _at_least("training.steps", t.steps, 1)
    _at_least("training.max_norm", t.max_norm, 0)
    _at_least("lr_scheduler.warmup_steps", s.warmup_steps, 0)
    _at_least("metrics.log_freq", m.log_freq, 1)
    _at_least("metrics.peak_flops", m.peak_flops, 0)
    if t.global_batch_size != -1 and t.global_batch_size < 1:
        raise ConfigError(f"training.global_batch_size = {t.global_batch_size}: use -1 or a positive number.")
    if o.zero_stage not in (0, 1):
        raise ConfigError(f"optimizer.zero_stage = {o.zero_stage}: use 0 (replicated state) or 1 (sharded over DP).")
    if o.bucket_size_mb <= 0:
        raise ConfigError(f"optimizer.bucket_size_mb = {o.bucket_size_mb}: it must be positive.")
    if o.lr <= 0:
        raise ConfigError(f"optimizer.lr = {o.lr}: the learning rate must be positive.")
    for key, value in (("optimizer.beta1", o.beta1), ("optimizer.beta2", o.beta2)):
        if not 0 <= value < 1:
            raise ConfigError(f"{key} = {value}: it must be in [0, 1).")
    for key, value in (("lr_scheduler.decay_ratio", s.decay_ratio), ("lr_scheduler.min_lr_factor", s.min_lr_factor)):
        if not 0 <= value <= 1:
            raise ConfigError(f"{key} = {value}: it must be in [0, 1].")
    c = config.checkpoint
    _at_least("checkpoint.interval", c.interval, 1)
    _at_least("checkpoint.keep_latest_k", c.keep_latest_k, 0)
    parts = ("model", "optimizer", "lr_scheduler", "dataloader", "rng")
    unknown = [part for part in c.exclude_from_loading if part not in parts]
    if unknown:
        raise ConfigError(
            f"checkpoint.exclude_from_loading names '{unknown[0]}'; the parts are: {', '.join(parts)}."
        )
    if c.initial_load_path and not Path(c.initial_load_path).is_dir():
        raise ConfigError(
            f"checkpoint.initial_load_path '{c.initial_load_path}' is not a folder. Give a checkpoint step-N "
            "folder or the output of `python -m torchpre.convert hf-to-dcp`."
        )
    _validate_dataset(config)


def _validate_dataset(config: JobConfig) -> None:
    """The data keys: a source that exists for the chosen `training.dataset`, sane mixture weights."""
    t = config.training
    _at_least("training.num_workers", t.num_workers, 0)
    if t.dataset == "text" and not t.dataset_path:
        raise ConfigError("training.dataset = 'text' needs training.dataset_path: a .txt or .jsonl file or a folder.")
    if t.dataset == "stdlib" and t.dataset_path:
        raise ConfigError(
            "training.dataset_path is set but training.dataset = 'stdlib' ignores it: "
            "set training.dataset = 'text' (text files) or 'shards' (a prepared shard folder)."
        )
    if t.dataset_mixture and t.dataset != "shards":
        raise ConfigError(
            f"training.dataset_mixture is set but training.dataset = '{t.dataset}' ignores it: "
            "set training.dataset = 'shards' to train on a mixture of shard folders."
        )
    if t.dataset != "shards":
        return
    if bool(t.dataset_path) == bool(t.dataset_mixture):
        raise ConfigError(
            "training.dataset = 'shards' needs exactly one of training.dataset_path (one shard folder) and "
            "training.dataset_mixture (folders and weights)."
        )
    key = "training.dataset_path" if t.dataset_path else "training.dataset_mixture"
    for path in [t.dataset_path] if t.dataset_path else t.dataset_mixture:
        if not Path(path).is_dir():
            raise ConfigError(
                f"{key}: the shard folder '{path}' does not exist or is not a folder. "
                "Create it with `python -m torchpre.data.prepare INPUT... --output DIR`."
            )
    for path, weight in t.dataset_mixture.items():
        if not (math.isfinite(weight) and weight > 0):
            raise ConfigError(
                f"training.dataset_mixture: the weight of '{path}' is {weight}; weights must be positive "
                "numbers (they are normalised to sum to 1)."
            )


def _at_least(key: str, value: float, minimum: float) -> None:
    if value < minimum:
        raise ConfigError(f"{key} = {value}: it must be at least {minimum}.")
