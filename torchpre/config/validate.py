"""Value checks that the type system cannot express, run before any expensive work."""

import math
import tempfile
from pathlib import Path

from torchpre.config.job_config import Checkpoint, JobConfig, Optimizer
from torchpre.errors import ConfigError
from torchpre.layouts.schedules import SCHEDULE_KEY, get_schedule, names_where
from torchpre.layouts.zero_stages import zero_stage
from torchpre.optional import import_tensorboard, import_wandb


def validate_config(config: JobConfig) -> None:
    """Raises ConfigError naming the first impossible value and what would be valid."""
    t, o, s, m = config.training, config.optimizer, config.lr_scheduler, config.metrics
    _at_least("training.local_batch_size", t.local_batch_size, 1)
    _at_least("training.seq_len", t.seq_len, 1)
    _at_least("training.steps", t.steps, 1)
    _at_least("training.loss_chunk_size", t.loss_chunk_size, 0)
    _at_least("training.max_norm", t.max_norm, 0)
    _at_least("lr_scheduler.warmup_steps", s.warmup_steps, 0)
    _at_least("metrics.log_freq", m.log_freq, 1)
    _at_least("metrics.peak_flops", m.peak_flops, 0)
    if not m.straggler_threshold > 0:
        raise ConfigError(
            f"metrics.straggler_threshold = {m.straggler_threshold}: it must be positive (e.g. 0.2: warn when the "
            "slowest rank is busy 20% longer per step than the median rank)."
        )
    _at_least("metrics.straggler_window", m.straggler_window, 1)
    # Every rank checks the trackers' packages: rank 0 alone failing later would leave its peers waiting.
    if m.enable_wandb:
        import_wandb()
    if m.enable_tensorboard:
        import_tensorboard()
    if t.global_batch_size != -1 and t.global_batch_size < 1:
        raise ConfigError(f"training.global_batch_size = {t.global_batch_size}: use -1 or a positive number.")
    _check_selective_ac_schedule(config)
    _check_optimizer(o)
    _check_data_parallel_degrees(config)
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
    _check_writable_folder("job.dump_folder", Path(config.job.dump_folder))
    if c.enable:
        _check_writable_folder("checkpoint.folder", Path(config.job.dump_folder) / c.folder)
    _at_least("checkpoint.interval", c.interval, 1)
    _at_least("checkpoint.keep_latest_k", c.keep_latest_k, 0)
    if c.save_on_preemption and not c.enable:
        raise ConfigError(
            "checkpoint.save_on_preemption saves a checkpoint on SIGTERM or SIGUSR1, but checkpoint.enable is off. "
            "Set checkpoint.enable = true, or turn checkpoint.save_on_preemption off."
        )
    _check_memory_snapshots(c)
    for key in ("init_timeout_seconds", "timeout_seconds"):
        seconds = getattr(config.comm, key)
        if not (math.isfinite(seconds) and seconds > 0):
            raise ConfigError(
                f"comm.{key} = {seconds}: it must be a positive number (seconds a rank waits for a peer before "
                "failing)."
            )
    _at_least("comm.trace_buf_size", config.comm.trace_buf_size, 0)
    _at_least("training.gc_freq", t.gc_freq, 0)
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
    _validate_validation(config)
    _validate_eval_and_export(config)
    _validate_health_and_profiling(config)


def _validate_dataset(config: JobConfig) -> None:
    """The data keys: a source that exists for the chosen `training.dataset`, sane mixture weights."""
    t = config.training
    _at_least("training.num_workers", t.num_workers, 0)
    _at_least("model.vocab_size", config.model.vocab_size, 0)
    _validate_text_source("training", t.dataset, t.dataset_path)
    if t.dataset == "synthetic" and t.dataset_path:
        raise ConfigError(
            "training.dataset_path is set but training.dataset = 'synthetic' (random tokens) reads no files: "
            "remove training.dataset_path, or set training.dataset = 'text' or 'shards'."
        )
    if t.dataset_mixture and t.dataset != "shards":
        raise ConfigError(
            f"training.dataset_mixture is set but training.dataset = '{t.dataset}' ignores it: "
            "set training.dataset = 'shards' to train on a mixture of shard folders."
        )
    if t.dataset != "shards":
        return
    # Data stages that all bring their own mixture need no data of the job's own.
    staged = bool(t.data_stages) and all(stage.mixture for stage in t.data_stages)
    if bool(t.dataset_path) == bool(t.dataset_mixture) and not (staged and not t.dataset_path):
        raise ConfigError(
            "training.dataset = 'shards' needs exactly one of training.dataset_path (one shard folder) and "
            "training.dataset_mixture (folders and weights), or a mixture in every [[training.data_stages]] table."
        )
    key = "training.dataset_path" if t.dataset_path else "training.dataset_mixture"
    for path in [t.dataset_path] if t.dataset_path else t.dataset_mixture:
        _check_shard_folder(key, path)
    mixtures = [("training.dataset_mixture", t.dataset_mixture)]
    mixtures += [(f"training.data_stages stage {i + 1}'s mixture", s.mixture) for i, s in enumerate(t.data_stages)]
    for key, mixture in mixtures:
        for path, weight in mixture.items():
            _check_shard_folder(key, path)
            if not (math.isfinite(weight) and weight > 0):
                raise ConfigError(
                    f"{key}: the weight of '{path}' is {weight}; weights must be positive numbers (they are "
                    "normalised to sum to 1)."
                )
    v = config.validation
    if v.enable and not v.dataset and not (t.dataset_path or t.dataset_mixture):
        raise ConfigError(
            "validation.enable holds out part of the job's data (validation.split_fraction), but every "
            "[[training.data_stages]] table brings its own mixture and training.dataset_path and dataset_mixture are "
            "empty. Give validation data of its own (validation.dataset, validation.dataset_path) or the job's data."
        )


def _validate_text_source(section: str, dataset: str, dataset_path: str) -> None:
    """The path rules shared by `training.dataset` and `validation.dataset`: 'text' needs a path and
    'stdlib' takes none (a path there is a mistake, not something to ignore silently)."""
    if dataset == "text" and not dataset_path:
        raise ConfigError(
            f"{section}.dataset = 'text' needs {section}.dataset_path: a .txt or .jsonl file or a folder."
        )
    if dataset == "stdlib" and dataset_path:
        raise ConfigError(
            f"{section}.dataset_path is set but {section}.dataset = 'stdlib' ignores it: "
            f"set {section}.dataset = 'text' (text files) or 'shards' (a prepared shard folder)."
        )


def _check_shard_folder(key: str, path: str) -> None:
    """A missing folder fails here, before any process group or model exists."""
    if not Path(path).is_dir():
        raise ConfigError(
            f"{key}: the shard folder '{path}' does not exist or is not a folder. "
            "Create it with `python -m torchpre.data.prepare INPUT... --output DIR`."
        )


def _validate_validation(config: JobConfig) -> None:
    """The [validation] keys: sizes, the held-out fraction, and a data source that is not the training data
    (evaluating on samples the model trains on would measure memorisation, not generalisation)."""
    v, t = config.validation, config.training
    _at_least("validation.freq", v.freq, 1)
    _at_least("validation.steps", v.steps, 1)
    if v.local_batch_size != -1 and v.local_batch_size < 1:
        raise ConfigError(
            f"validation.local_batch_size = {v.local_batch_size}: use -1 (training.local_batch_size) or a positive "
            "number."
        )
    if not 0 < v.split_fraction < 1:
        raise ConfigError(
            f"validation.split_fraction = {v.split_fraction}: the fraction of the training samples held out for "
            "validation must be in (0, 1), leaving both validation and training data."
        )
    if not v.enable:
        return
    schedule = config.parallelism.pipeline_parallel_schedule
    if config.parallelism.pipeline_parallel_degree > 1 and not get_schedule(schedule).forward_only:
        raise ConfigError(
            f"validation.enable: evaluation cannot run under {SCHEDULE_KEY} = '{schedule}' "
            "(torch.distributed.pipelining cannot run it forward-only). Use one of "
            f"{', '.join(names_where(forward_only=True))}, or turn validation off."
        )
    if not v.dataset:
        if t.dataset == "synthetic":
            raise ConfigError(
                "validation.enable with training.dataset = 'synthetic': random tokens hold nothing to learn, so a "
                "held-out part of them measures nothing. Set validation.dataset (and dataset_path), or turn "
                "validation off."
            )
        if v.dataset_path:
            raise ConfigError(
                "validation.dataset_path is set but validation.dataset is empty (hold out part of the training "
                "data): set validation.dataset = 'text' or 'shards' to validate on that path."
            )
        return
    _validate_text_source("validation", v.dataset, v.dataset_path)
    if v.dataset == "text" and not Path(v.dataset_path).exists():
        raise ConfigError(
            f"validation.dataset_path '{v.dataset_path}' does not exist. "
            "Give a .txt or .jsonl file, or a folder holding such files."
        )
    if v.dataset == "shards":
        if not v.dataset_path:
            raise ConfigError("validation.dataset = 'shards' needs validation.dataset_path (one shard folder).")
        _check_shard_folder("validation.dataset_path", v.dataset_path)
    if _same_source(v.dataset, v.dataset_path, t.dataset, t.dataset_path):
        raise ConfigError(
            f"validation.dataset = '{v.dataset}' with validation.dataset_path = '{v.dataset_path}' is the training "
            "data, so the model would be evaluated on samples it trains on. Leave validation.dataset empty to hold "
            "out validation.split_fraction of the training data, or point it at other data."
        )


def _validate_eval_and_export(config: JobConfig) -> None:
    """The [eval] and [hf_export] keys (the task files' contents are read, line by line, at start-up)."""
    e, h = config.eval, config.hf_export
    _at_least("eval.freq", e.freq, 1)
    _at_least("eval.local_batch_size", e.local_batch_size, 1)
    _at_least("eval.max_length", e.max_length, 0)
    tp, window = config.parallelism.tensor_parallel_degree, e.max_length or config.training.seq_len
    if e.tasks and tp > 1 and config.parallelism.enable_sequence_parallel and window % tp:
        raise ConfigError(
            f"eval.max_length = {window} (0: training.seq_len) is not divisible by "
            f"parallelism.tensor_parallel_degree = {tp}: sequence parallelism splits an evaluation row's positions "
            f"evenly over the ranks. Use a multiple of {tp}."
        )
    not_jsonl = [path for path in e.tasks if not path.endswith(".jsonl")]
    if not_jsonl:
        raise ConfigError(
            f"eval.tasks names '{not_jsonl[0]}': a task is a .jsonl file of multiple-choice questions, one "
            '{"context": ..., "choices": [...], "answer": ...} object a line.'
        )
    if e.tasks and config.parallelism.context_parallel_degree > 1:
        raise ConfigError(
            "eval.tasks: multiple-choice evaluation does not run under parallelism.context_parallel_degree > 1 (it "
            "scores whole sequences on one rank). Evaluate the Hugging Face exports instead (hf_export), or train "
            "without context parallelism."
        )
    _at_least("hf_export.interval", h.interval, 1)
    _at_least("hf_export.keep_latest_k", h.keep_latest_k, 0)
    if h.enable:
        _check_writable_folder("hf_export.folder", Path(config.job.dump_folder) / h.folder)
        if config.checkpoint.enable and Path(config.job.dump_folder, h.folder) == Path(
            config.job.dump_folder, config.checkpoint.folder
        ):
            raise ConfigError(
                f"hf_export.folder = checkpoint.folder = '{h.folder}': exports and checkpoints are both step-N "
                "folders, so one would replace the other. Give hf_export.folder another name (default 'hf')."
            )


def _same_source(dataset: str, path: str, other_dataset: str, other_path: str) -> bool:
    """Same kind and the same file or folder (or both without a path: the built-in corpus)."""
    if dataset != other_dataset or bool(path) != bool(other_path):
        return False
    return not path or Path(path).resolve() == Path(other_path).resolve()


def _validate_health_and_profiling(config: JobConfig) -> None:
    t, p = config.training, config.profiling
    _at_least("training.spike_zscore", t.spike_zscore, 0)
    _at_least("training.nonfinite_forensics", t.nonfinite_forensics, 0)
    _at_least("training.spike_window", t.spike_window, 2)
    _at_least("profiling.profile_active", p.profile_active, 1)
    if p.profile_freq < p.profile_active:
        raise ConfigError(
            f"profiling.profile_freq = {p.profile_freq} is smaller than profiling.profile_active = "
            f"{p.profile_active}: a trace records profile_active steps out of every profile_freq."
        )


def _check_writable_folder(key: str, folder: Path) -> None:
    """A folder the job will create and write into must not be a file, nor lie under one, and the job must be allowed
    to write in it (or in the folder it will be created in): tried with a nameless file that vanishes when closed, as
    permissions alone do not tell (root ignores them; a read-only or special file system refuses anyone)."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        where = "is a file" if existing == folder else f"lies under the file {existing}"
        raise ConfigError(f"{key} '{folder}' {where}, so the job cannot write there. Give a folder path.")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        where = "" if existing == folder else f" (it would be created in {existing})"
        raise ConfigError(
            f"{key} '{folder}': the job cannot write there{where}: {error.strerror}. Give a folder this user may "
            "write in, or change its permissions."
        ) from None


def _check_data_parallel_degrees(config: JobConfig) -> None:
    """The HSDP degrees' values; what they mean for a ZeRO stage is `torchpre.parallel.data_parallel`'s to check."""
    p = config.parallelism
    _at_least("parallelism.data_parallel_replicate_degree", p.data_parallel_replicate_degree, 1)
    if p.data_parallel_shard_degree != -1 and p.data_parallel_shard_degree < 1:
        raise ConfigError(
            f"parallelism.data_parallel_shard_degree = {p.data_parallel_shard_degree}: use -1 (data-parallel "
            "degree / replicate degree) or >= 1."
        )


def _at_least(key: str, value: float, minimum: float) -> None:
    if value < minimum:
        raise ConfigError(f"{key} = {value}: it must be at least {minimum}.")


def _check_selective_ac_schedule(config: JobConfig) -> None:
    """Per-op selective checkpointing keeps each saved op output for one backward through the block; a zero-bubble
    schedule runs two (input gradients, then weight gradients), and torch fails in the second."""
    ac, p = config.activation_checkpoint, config.parallelism
    per_op = ac.mode == "selective" and ac.selective_ac_option == "op"
    if per_op and p.pipeline_parallel_degree > 1 and get_schedule(p.pipeline_parallel_schedule).zero_bubble:
        raise ConfigError(
            f"activation_checkpoint.selective_ac_option = 'op' cannot run under {SCHEDULE_KEY} = "
            f"'{p.pipeline_parallel_schedule}': a zero-bubble schedule splits each backward in two (input, then "
            "weight gradients), and torch's per-op selective checkpointing allows one backward per block. Use "
            "activation_checkpoint.mode = 'full' or selective_ac_option = N (every N-th block, fully), or "
            f"another schedule ({', '.join(names_where(zero_bubble=False))})."
        )


def _check_optimizer(o: Optimizer) -> None:
    """The optimizer's values; its name and the keys it reads are the optimizer registry's to check
    (`torchpre.optim.registry.check_config`), which needs torch."""
    zero_stage(o.zero_stage)  # an unknown ZeRO stage, named with the valid ones
    if o.momentum < 0:
        raise ConfigError(f"optimizer.momentum = {o.momentum}: it must be >= 0.")


def _check_memory_snapshots(c: Checkpoint) -> None:
    """checkpoint.memory_*: snapshots belong to a run of checkpoints (its run id, its disk fallback)."""
    _at_least("checkpoint.memory_interval", c.memory_interval, 0)
    if c.memory_replicas not in (0, 1):
        raise ConfigError(
            f"checkpoint.memory_replicas = {c.memory_replicas}: it must be 0 (no replica) or 1 (one replica on a "
            "peer rank of another node)."
        )
    if c.memory_interval and not c.enable:
        raise ConfigError(
            f"checkpoint.memory_interval = {c.memory_interval} takes in-memory snapshots, but checkpoint.enable is "
            "off: a snapshot belongs to a run of checkpoints (its run id, and the disk checkpoint it falls back to). "
            "Set checkpoint.enable = true, or checkpoint.memory_interval = 0."
        )
    if c.memory_interval and c.model_only:
        raise ConfigError(
            "checkpoint.memory_interval resumes the whole training state, but checkpoint.model_only saves the "
            "weights alone. Turn one of them off."
        )
    if c.memory_interval and not c.memory_folder:
        raise ConfigError(
            "checkpoint.memory_folder is empty. Give a folder in host memory, e.g. /dev/shm/torchpre (the default)."
        )
