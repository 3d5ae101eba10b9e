"""Value checks that the type system cannot express, run before any expensive work: each key's own bound is
declared with its field (job_config.py); the checks here read keys together, one function per section."""

import dataclasses
import math
import tempfile
from pathlib import Path

from torchpre.config.bounds import check_bounds
from torchpre.config.job_config import CHECKPOINT_ENTRIES, Checkpoint, JobConfig
from torchpre.config.training_schedule import check_data_stage, ramp_values
from torchpre.errors import ConfigError, resolve_step
from torchpre.optional import import_tensorboard, import_wandb
from torchpre.step_rules.schedules import SCHEDULE_KEY, get_schedule, names_where
from torchpre.step_rules.zero_stages import zero_stage


@resolve_step
def validate_config(config: JobConfig) -> None:
    """Raises ConfigError naming the first impossible value and what would be valid: first every key's own bound,
    declared with its field (`torchpre.config.bounds`), then each section's checks of its keys together."""
    check_section_bounds(config)
    for check in SECTION_CHECKS:
        check(config)


def check_section_bounds(config: JobConfig) -> None:
    """Every section's keys against the bounds declared with them; generation, which reads a training job's
    config but none of its data or folders, checks these alone."""
    for field in dataclasses.fields(config):
        section = getattr(config, field.name)
        if dataclasses.is_dataclass(section):
            check_bounds(section, f"{field.name}.")


def _check_job(config: JobConfig) -> None:
    """The dump folder: every output of the job goes there, so one it cannot write fails now, not at a save."""
    _check_writable_folder("job.dump_folder", Path(config.job.dump_folder))


def _check_metrics(config: JobConfig) -> None:
    """Every rank checks the trackers' packages: rank 0 alone failing later would leave its peers waiting."""
    if config.metrics.enable_wandb:
        import_wandb()
    if config.metrics.enable_tensorboard:
        import_tensorboard()


def _check_optimizer(config: JobConfig) -> None:
    """The ZeRO stage and what it needs of the data-parallel keys; the optimizer's name and the keys it reads are
    the optimizer registry's to check (`torchpre.optim.registry.check_config`), which needs torch."""
    t, p = config.training, config.parallelism
    stage = zero_stage(config.optimizer.zero_stage)  # an unknown ZeRO stage, named with the valid ones
    if p.data_parallel_replicate_degree > 1 and not stage.shards_parameters:
        raise ConfigError(
            f"parallelism.data_parallel_replicate_degree = {p.data_parallel_replicate_degree} asks for HSDP, "
            "which replicates FSDP shards: set optimizer.zero_stage = 3, or the replicate degree to 1."
        )
    if not stage.shards_parameters:
        return
    # What ZeRO-3 (FSDP2) cannot run, or runs differently.
    if t.mixed_precision_grad != "float32":
        raise ConfigError(
            f"training.mixed_precision_grad = {t.mixed_precision_grad} with optimizer.zero_stage = 3: FSDP keeps the "
            "sharded gradients in fp32 and reduces them in optimizer.reduce_dtype. Set "
            "training.mixed_precision_grad = float32, and optimizer.reduce_dtype = bfloat16 for a bf16 reduction."
        )
    if p.data_parallel_shard_degree != -1 and p.data_parallel_degree != -1:
        product = p.data_parallel_replicate_degree * p.data_parallel_shard_degree
        if product != p.data_parallel_degree:
            raise ConfigError(
                f"parallelism.data_parallel_replicate_degree x data_parallel_shard_degree = "
                f"{p.data_parallel_replicate_degree} x {p.data_parallel_shard_degree} = {product} must equal "
                f"parallelism.data_parallel_degree = {p.data_parallel_degree}. Set data_parallel_shard_degree = -1."
            )


def _check_quantize(config: JobConfig) -> None:
    """[quantize]: a recipe the format has, and FP8 all-gather only where one scale can serve every shard: the
    amax of the whole weight, all-reduced over the data-parallel shards before the gather. Only tensorwise FP8 has
    such a scale, only ZeRO-3 gathers, and under tensor parallelism torchao reduces that amax over the data-parallel
    shards alone (measured: tp2 x dp2 losses 1e-5 off the high-precision gather, which equals it bitwise without
    tp). The format's package and the sequences a rank sees are `torchpre.assembly.layout_checks.check_quantize`'s."""
    q, key = config.quantize, "quantize.fsdp_float8_all_gather"
    if q.linear == "mxfp8" and q.recipe == "tensorwise":
        raise ConfigError(
            "quantize.recipe = 'tensorwise' with quantize.linear = 'mxfp8': MXFP8 scales every block of 32 values, "
            "never a whole tensor. Use quantize.recipe = 'rowwise' (or 'rowwise_with_gw_hp': weight gradients in "
            "high precision), or quantize.linear = 'float8'."
        )
    if not q.fsdp_float8_all_gather:
        return
    if q.linear != "float8" or q.recipe != "tensorwise":
        raise ConfigError(
            f"{key} with quantize.linear = '{q.linear}' and quantize.recipe = '{q.recipe}': FP8 all-gather sends each "
            "weight with one scale for the whole tensor, which only quantize.linear = 'float8' with quantize.recipe "
            f"= 'tensorwise' has. Use those, or turn {key} off."
        )
    stage = config.optimizer.zero_stage
    if not zero_stage(stage).shards_parameters:
        raise ConfigError(
            f"{key} with optimizer.zero_stage = {stage}: only ZeRO-3 (FSDP2) all-gathers the weights before "
            f"each forward; set optimizer.zero_stage = 3, or turn {key} off."
        )
    tp = config.parallelism.tensor_parallel_degree
    if tp > 1:
        raise ConfigError(
            f"{key} with parallelism.tensor_parallel_degree = {tp}: torchao takes the weight's "
            "FP8 scale from the amax of the data-parallel shards only, so each tensor-parallel shard would get its "
            f"own scale and the run would depend on the layout. Turn {key} off (the weights are then gathered in "
            "high precision and cast with the amax of the whole weight), or use tensor_parallel_degree = 1."
        )


def _check_checkpoint(config: JobConfig) -> None:
    """[checkpoint]: a folder the job can write, the entries it may skip on load, the initial weights' folder, and
    what preemption saves and in-memory snapshots need of the rest."""
    c = config.checkpoint
    if c.enable:
        _check_writable_folder("checkpoint.folder", Path(config.job.dump_folder) / c.folder)
    if c.save_on_preemption and not c.enable:
        raise ConfigError(
            "checkpoint.save_on_preemption saves a checkpoint on SIGTERM or SIGUSR1, but checkpoint.enable is off. "
            "Set checkpoint.enable = true, or turn checkpoint.save_on_preemption off."
        )
    _check_memory_snapshots(c)
    unknown = [entry for entry in c.exclude_from_loading if entry not in CHECKPOINT_ENTRIES]
    if unknown:
        raise ConfigError(
            f"checkpoint.exclude_from_loading names '{unknown[0]}'; the parts are: {', '.join(CHECKPOINT_ENTRIES)}."
        )
    if c.initial_load_path and not Path(c.initial_load_path).is_dir():
        raise ConfigError(
            f"checkpoint.initial_load_path '{c.initial_load_path}' is not a folder. Give a checkpoint step-N "
            "folder or the output of `python -m torchpre.convert hf-to-dcp`."
        )


def _check_training_schedule(config: JobConfig) -> None:
    """training.batch_rampup's numbers and each data stage's own values (`torchpre.config.training_schedule`)."""
    t = config.training
    ramp_values(t.batch_rampup, t.global_batch_size)
    for index, entry in enumerate(t.data_stages):
        check_data_stage(config, index, entry)


def _check_training_data(config: JobConfig) -> None:
    """The data keys: a source that exists for the chosen `training.dataset`, sane mixture weights."""
    t = config.training
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


def _check_validation(config: JobConfig) -> None:
    """The [validation] data: a source that is not the training data (evaluating on samples the model trains on
    would measure memorisation, not generalisation), and a schedule that can run forward-only."""
    v, t = config.validation, config.training
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


def _check_eval(config: JobConfig) -> None:
    """The [eval] keys (the task files' contents are read, line by line, at start-up)."""
    e = config.eval
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


def _check_hf_export(config: JobConfig) -> None:
    """[hf_export]: a folder the job can write that is not the checkpoints'."""
    h = config.hf_export
    if not h.enable:
        return
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


def _check_profiling(config: JobConfig) -> None:
    p = config.profiling
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


def _check_activation_checkpoint(config: JobConfig) -> None:
    """selective_ac_option: 'op' or every N-th block. Per-op selective checkpointing keeps each saved op output for
    one backward through the block; a zero-bubble schedule runs two (input gradients, then weight gradients), and
    torch fails in the second."""
    ac, p = config.activation_checkpoint, config.parallelism
    option = ac.selective_ac_option
    if ac.mode == "selective" and option != "op" and (not option.isdigit() or int(option) < 1):
        raise ConfigError(
            f"activation_checkpoint.selective_ac_option = '{option}': use 'op' or a positive integer N (checkpoint "
            "every N-th block)."
        )
    per_op = ac.mode == "selective" and ac.selective_ac_option == "op"
    if per_op and p.pipeline_parallel_degree > 1 and get_schedule(p.pipeline_parallel_schedule).zero_bubble:
        raise ConfigError(
            f"activation_checkpoint.selective_ac_option = 'op' cannot run under {SCHEDULE_KEY} = "
            f"'{p.pipeline_parallel_schedule}': a zero-bubble schedule splits each backward in two (input, then "
            "weight gradients), and torch's per-op selective checkpointing allows one backward per block. Use "
            "activation_checkpoint.mode = 'full' or selective_ac_option = N (every N-th block, fully), or "
            f"another schedule ({', '.join(names_where(zero_bubble=False))})."
        )


def _check_memory_snapshots(c: Checkpoint) -> None:
    """checkpoint.memory_*: snapshots belong to a run of checkpoints (its run id, its disk fallback)."""
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


# Each section's checks of its keys together, in the order they run (a job's folder first: everything writes there).
SECTION_CHECKS = (
    _check_job,
    _check_metrics,
    _check_activation_checkpoint,
    _check_optimizer,
    _check_quantize,
    _check_checkpoint,
    _check_training_schedule,
    _check_training_data,
    _check_validation,
    _check_eval,
    _check_hf_export,
    _check_profiling,
)
