"""Dry run: a job's start-up and memory at its full world size, one rank at a time, in one process.

`python -m torchpre.train ... --job.dry_run` builds the real training job for chosen ranks of the configured world
(`Runtime.fake`: torch's fake process group stands in for the other ranks, every tensor lives on the meta
device), so it meets every check a real start-up meets, with the same message. For each rank it reports the
bytes of parameters, gradients and optimizer state that rank holds (read from the optimizer that would train,
not from a formula), the activations one training step keeps (`activation_memory`), and the checkpoint it
would write, then exits 0 when every rank fits `job.dry_run_gpu`'s memory and 2 naming the rank otherwise.
"""

import copy
import dataclasses
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.tensor import DTensor

from torchpre.config.job_config import JobConfig
from torchpre.errors import ConfigError, TorchpreError
from torchpre.models.registry import get_model_spec
from torchpre.parallel.tensor_parallel import loss_parallel_context
from torchpre.planner.activation_probe import (
    ActivationProbe,
    ProbeMode,
    cuda_rms_norm,
    meta_flash_attention,
    probe_microbatch,
)
from torchpre.planner.allocator import FRAGMENTATION, reserved_bytes
from torchpre.planner.hardware import Hardware, get_hardware
from torchpre.planner.schedule_walk import held_peak
from torchpre.planner.tensor_memory import TensorMemory
from torchpre.runtime.world import Runtime
from torchpre.training.job import TrainingJob, build_job

logger = logging.getLogger("torchpre")

GiB = 2**30


class DoesNotFit(TorchpreError):
    """A rank of a dry run needs more memory than the GPU has."""


@dataclass(frozen=True)
class RankMemory:
    """What one rank holds during training, in bytes. `activation_bytes` is the peak of what a step keeps for
    backward plus the largest transient of a forward or backward (see `probe_rank`); `optimizer_step_bytes` the
    transient of the optimizer step (gradient reduction, update, parameter all-gather), which comes after the
    activations are freed: the peak is the larger of the two on top of the model state."""

    rank: int
    pp: int
    dp: int
    tp: int
    param_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    activation_bytes: int
    checkpoint_bytes: int
    optimizer_step_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return peak_bytes(self)

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total_bytes": self.total_bytes}


def peak_bytes(memory: Any) -> int:
    """A rank's peak: its model state plus the larger of the activations (backward's peak) and the optimizer
    step's buffers (which come after the activations are freed). Shared with the planner's predictions."""
    state = memory.param_bytes + memory.grad_bytes + memory.optimizer_state_bytes
    return state + max(memory.activation_bytes, memory.optimizer_step_bytes)


def dry_run_world_size(config: JobConfig) -> int:
    """job.dry_run_world_size, else the product of the explicit parallelism degrees."""
    job, p = config.job, config.parallelism
    if job.dry_run_world_size < 0:
        raise ConfigError(f"job.dry_run_world_size = {job.dry_run_world_size}: use 0 (from the degrees) or >= 1.")
    if job.dry_run_world_size:
        return job.dry_run_world_size
    dp = p.data_parallel_degree
    if dp == -1 and p.data_parallel_shard_degree != -1:
        dp = p.data_parallel_replicate_degree * p.data_parallel_shard_degree
    if dp == -1:
        raise ConfigError(
            "job.dry_run needs the world size: parallelism.data_parallel_degree is -1 (all remaining processes). "
            "Set job.dry_run_world_size = N (the processes the real job launches) or an explicit "
            "parallelism.data_parallel_degree."
        )
    return dp * p.context_parallel_degree * p.tensor_parallel_degree * p.pipeline_parallel_degree


def dry_run_ranks(config: JobConfig, world_size: int) -> list[int]:
    """job.dry_run_rank, else the first rank (dp 0, tp 0) of every pipeline stage: the largest ZeRO shards
    (torch.chunk gives rank 0 the remainder) and, between them, every stage's share of the model."""
    ranks = config.job.dry_run_rank
    for rank in ranks:
        if not 0 <= rank < world_size:
            raise ConfigError(f"job.dry_run_rank = {rank}: the dry run's world has ranks 0..{world_size - 1}.")
    if ranks:
        return list(ranks)
    pp = config.parallelism.pipeline_parallel_degree
    return [stage * (world_size // pp) for stage in range(pp)]


def run_dry_run(config: JobConfig) -> list[RankMemory]:
    """Builds each chosen rank, prints the memory table, and raises DoesNotFit when a rank does not fit."""
    hardware = get_hardware(config.job.dry_run_gpu)
    world_size = dry_run_world_size(config)
    ranks = dry_run_ranks(config, world_size)
    start = time.perf_counter()
    results = [build_rank(config, world_size, rank) for rank in ranks]
    print(memory_table(results, hardware))
    if get_model_spec(config.model.name).parallel.expert_parallel is not None:
        print(
            f"activ: model.name = '{config.model.name}' routes tokens by their values, which meta tensors do not "
            "have: counted for a balanced router (each expert an equal share of the routed rows)"
        )
    logger.info("dry run of %d ranks of a %d-rank world in %.1f s", len(ranks), world_size, time.perf_counter() - start)
    check_fits(results, hardware)
    return results


def build_rank(config: JobConfig, world_size: int, rank: int, checkpoint: bool = True) -> RankMemory:
    """One rank of the job, built as training builds it (`build_job`) in a fake world, and what it holds."""
    return probe_rank(config, world_size, rank, checkpoint)[0]


def probe_rank(
    config: JobConfig, world_size: int, rank: int, checkpoint: bool = True, data: bool = True
) -> tuple[RankMemory, list["PartProbe"]]:
    """`build_rank`, and the probes of the rank's parts its activations were counted from; `data=False` builds
    no data loader (the planner's probes: shortened models of a job whose data need not exist yet)."""
    job = build_job(config, Runtime(world_size, fake_rank=rank, data=data))
    try:
        memory = rank_memory(job, checkpoint)
        gathered, pp_rank = _fsdp_gathered(job), job.mesh["pp"].get_local_rank()
        if job.pipeline is not None and job.preflight.data_parallel.shards_parameters:
            memory = dataclasses.replace(memory, grad_bytes=_fsdp_unsharded_numel(job) * accumulated_grad_itemsize(
                job.config))  # fmt: skip
        step = optimizer_step_bytes(job)
        parts = probe_parts(job)
    finally:
        leave_fake_world()
    transient = max(p.total.transient_bytes for p in parts)
    activations = _held_activations(job, parts, pp_rank) + transient + gathered
    return dataclasses.replace(memory, activation_bytes=activations, optimizer_step_bytes=step), parts


def optimizer_step_bytes(job: TrainingJob) -> int:
    """The transient bytes of one optimizer step on this rank, counted by running it on meta: ZeRO 0-2 reduce
    their (persistent) gradient buckets; a reduction that keeps the gradients in the parameters (ZeRO-3's sharded
    ones, a data-parallel group of one) steps on them (made here, outside the count: they are `grad_bytes`). The
    first step's optimizer state already exists (`rank_memory` made it)."""
    if job.reduction.grads_in_parameters:
        for part in job.model.parts:
            for param in part.parameters():
                param.grad = torch.zeros_like(param)
    counter = TensorMemory(("meta",))
    with counter:
        counter.begin_step()
        job.optimizer.step()
    return counter.peak - counter.step_start


def probe_rank_parts(config: JobConfig, world_size: int, rank: int) -> list["PartProbe"]:
    """`probe_rank`'s probes of the rank's parts alone (there they run after an optimizer step, which leaves no
    gradients, as here), without counting its memory or running that step: the planner's microbatch costs need
    only the probes (counted equal: `tests/unit/test_plan.py`)."""
    job = build_job(config, Runtime(world_size, fake_rank=rank, data=False))
    try:
        return probe_parts(job)
    finally:
        leave_fake_world()


def leave_fake_world() -> None:
    """Destroys the fake process group and forgets DTensor's cached sharding decisions: their specs hold the
    meshes of this world, which compare equal to the next rank's, so the next rank would issue collectives on
    this world's (destroyed) groups."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    if dist.is_initialized():
        dist.destroy_process_group()
    _clear_sharding_prop_cache()


def rank_memory(job: TrainingJob, checkpoint: bool = True) -> RankMemory:
    """The model state the rank `job` was built for holds, in bytes (its fake process group still joined;
    activations 0: see `probe_rank`); `checkpoint=False` skips planning the checkpoint (reported as 0)."""
    optimizer = job.optimizer
    state = optimizer.state_dict()  # creates the state as the first step (and a first checkpoint) would
    coordinates = job.mesh.get_coordinate()
    return RankMemory(
        rank=dist.get_rank(),
        pp=coordinates[0],
        dp=coordinates[1],
        tp=coordinates[2],
        param_bytes=optimizer.param_bytes(),
        grad_bytes=optimizer.grad_bytes(),
        optimizer_state_bytes=optimizer.state_bytes(),
        activation_bytes=0,
        checkpoint_bytes=_checkpoint_bytes(job, state) if checkpoint else 0,
    )


@dataclass(frozen=True)
class PartProbe:
    """One microbatch through one of a rank's model parts (a pipeline stage, or the whole model): the counts of
    its forward and backward together (`total`) and of its forward alone (`forward`), and the bytes of the
    activation it hands to the next stage (0 for the last). Under pipelining torch's PipelineStage also keeps,
    per microbatch in flight, the input it received (`received_bytes`, 0 on the first stage) and, on the last
    stage, its output (`held_output_bytes`: the logits, cached until backward)."""

    total: ActivationProbe
    forward: ActivationProbe
    boundary_bytes: int
    received_bytes: int
    held_output_bytes: int

    @property
    def pipeline_held_bytes(self) -> int:
        return self.received_bytes + self.held_output_bytes


def probe_parts(job: TrainingJob) -> list[PartProbe]:
    """Runs one microbatch of synthetic inputs with the job's shapes through each of this rank's parts on the
    meta device, as training runs it (loss parallel, the training loss on the last stage), and counts it.

    The first stage takes token ids, a later one the residual stream [microbatch, seq (/ cp) (/ tp under sequence
    parallelism), dim] in the compute dtype that the stage before sends. ZeRO-3 parts are probed on a ZeRO-1
    build of the same rank (FSDP2 cannot run on meta tensors); `activation_bytes` adds the parameters FSDP
    gathers.
    """
    if job.preflight.data_parallel.shards_parameters:
        return _probe_without_fsdp(job)
    config, dims = job.config, job.dims
    p = config.parallelism
    microbatch = p.pipeline_parallel_microbatch_size if job.pipeline else config.training.local_batch_size
    # The longest data stage's sequences; a cp rank holds its share of each sequence, gathers k and v.
    seq = job.preflight.plan.peak(config.training.steps)[1] // dims.cp
    tokens = torch.zeros(microbatch, seq, dtype=torch.long, device="meta")
    sequence_parallel = p.enable_sequence_parallel and dims.tp > 1
    hidden_shape = (microbatch, seq // dims.tp if sequence_parallel else seq, job.preflight.model_args.dim)
    dtype = getattr(torch, config.training.mixed_precision_param)
    model = job.model
    model.set_backward_callback(None)
    probes = []
    # Compiled blocks run eager: dynamo cannot trace under the probe's dispatch modes, and the eager ops are what
    # it counts (the planner models what compile saves: torchpre.planner.allocator, time_model.COMPILE_ELEMENTWISE).
    with loss_parallel_context(p.enable_loss_parallel and dims.tp > 1), torch.compiler.set_stance("force_eager"):
        for part, stage in zip(model.parts, model.stage_ids):
            first, last = stage == 0, stage == (job.pipeline.num_stages - 1 if job.pipeline else 0)
            inputs = tokens if first else torch.empty(hidden_shape, dtype=dtype, device="meta", requires_grad=True)
            kwargs = job.forward_inputs(tokens)
            loss_fn = (lambda logits: job.loss(logits, tokens)) if last else None
            total = probe_microbatch(part, (inputs,), kwargs, loss_fn=loss_fn, devices=("meta",))
            boundary = 0 if last else _nbytes(hidden_shape, dtype)
            forward, output_bytes = _probe_forward(part, inputs, kwargs)
            received = 0 if first else _nbytes(hidden_shape, dtype)
            probes.append(PartProbe(total, forward, boundary, received, output_bytes if last else 0))
            for param in part.parameters():
                param.grad = None
    return probes


def _probe_forward(part: torch.nn.Module, inputs: torch.Tensor, kwargs: dict) -> tuple[ActivationProbe, int]:
    """The counts of the forward alone (no graph kept): the forward's share of FLOPs, bytes, ops and
    collectives, so the planner can tell the backward's (which DP reductions overlap) from the whole; and the
    bytes of the part's output on this rank."""
    mode = ProbeMode(("meta",))
    with meta_flash_attention(), cuda_rms_norm(), mode, torch.no_grad():
        mode.begin_step()
        output = part(inputs, **kwargs)
    local = output.to_local() if isinstance(output, DTensor) else output
    return mode.counts(0, max(0, mode.peak - mode.step_start), 0), _nbytes(tuple(local.shape), local.dtype)


def _probe_without_fsdp(job: TrainingJob) -> list[PartProbe]:
    config = copy.deepcopy(job.config)
    config.optimizer.zero_stage = 1
    rank, world = dist.get_rank(), dist.get_world_size()
    leave_fake_world()  # the twin joins its own fake world; the ZeRO-3 job is not used again
    return probe_parts(build_job(config, Runtime(world, fake_rank=rank, data=False)))


def _held_activations(job: TrainingJob, parts: list["PartProbe"], pp_rank: int) -> int:
    """The saved activations this rank holds at once at the peak of a step: one microbatch's without pipelining
    (microbatches run one after another); under it, each stage chunk's (with what the PipelineStage keeps per
    microbatch) for every microbatch in flight, walked over the schedule's action order (`held_peak`: a last
    stage's chunk, logits and all, is held for one microbatch where a multi-stage schedule runs its backward at
    once)."""
    pipeline = job.pipeline
    if pipeline is None:
        return parts[0].total.saved_bytes
    # A global-batch ramp's largest step runs the most microbatches.
    sequences = job.preflight.plan.peak(job.config.training.steps)[0]
    n_microbatches = sequences // job.config.parallelism.pipeline_parallel_microbatch_size
    chunks = [p.total.saved_bytes + p.pipeline_held_bytes for p in parts]
    return round(held_peak(pipeline.schedule.name, pipeline.pp, n_microbatches, pp_rank, chunks))


def _fsdp_gathered(job: TrainingJob) -> int:
    """Under ZeRO-3, the unsharded compute-dtype parameters FSDP2 holds on top of its shards: with resharding
    after forward, the largest block's `gathered_blocks` times; without (the default under pipelining), the whole
    rank's, from the first forward to the step."""
    if not job.preflight.data_parallel.shards_parameters:
        return 0
    itemsize = getattr(torch, job.config.training.mixed_precision_param).itemsize
    if not job.model.plan.fsdp.reshard_after_forward:
        return _fsdp_unsharded_numel(job) * itemsize
    blocks: dict[str, int] = {}
    for part in job.model.parts:
        for name, param in part.named_parameters():
            block = ".".join(name.split(".")[:2])
            blocks[block] = blocks.get(block, 0) + unsharded_numel(param, job) * itemsize
    return gathered_blocks(job.config) * max(blocks.values())


def gathered_blocks(config: JobConfig) -> int:
    """Blocks' worth of parameters FSDP2 holds gathered at a step's peak when it reshards after forward: it
    gathers one unit ahead of the one running, so two blocks with units per block; one with units per sub-layer
    (`parallelism.fsdp_wrap = "sublayer"`: the feed-forward running in backward, the attention prefetched and
    their block's norms). tests/distributed/test_fsdp_sublayer.py counts both."""
    return 1 if config.parallelism.fsdp_wrap == "sublayer" else 2


def _fsdp_unsharded_numel(job: TrainingJob) -> int:
    return sum(unsharded_numel(param, job) for part in job.model.parts for param in part.parameters())


def accumulated_grad_itemsize(config: JobConfig) -> int:
    """Under pipelining, ZeRO-3's gradients are unsharded for the whole step: the schedule turns FSDP2's gradient
    sync off until the last microbatch's backward, so FSDP2 keeps every parameter's unsharded gradient, adding each
    microbatch's to it, and reduce-scatters them once, after the activations are freed. It accumulates them in the
    reduce dtype when that differs from the compute dtype (bf16 compute, fp32 reduce: 4 bytes an element, as
    `to_accumulated_grad_if_needed` upcasts them), else in the compute dtype."""
    compute = getattr(torch, config.training.mixed_precision_param)
    reduce = getattr(torch, config.optimizer.reduce_dtype)
    return (reduce if reduce != compute else compute).itemsize


def is_expert(param: torch.Tensor) -> bool:
    """Whether expert parallelism placed `param` (a grouped-experts weight: a DTensor on a mesh with `ep`)."""
    return isinstance(param, DTensor) and "ep" in (param.device_mesh.mesh_dim_names or ())


def unsharded_numel(param: torch.Tensor, job: TrainingJob) -> int:
    """`param`'s elements on this rank before data-parallel sharding (what ZeRO-3 gathers, what DP reduces): FSDP2
    shards a dense parameter over dp_shard x cp ranks, and an expert-parallel expert over the dp_shard x cp / ep
    ranks that hold the same experts (edp_shard)."""
    local = param.to_local().numel() if isinstance(param, DTensor) else param.numel()
    if not job.preflight.data_parallel.shards_parameters:
        return local
    dims = job.dims
    ranks = dims.dp_shard * dims.cp
    return local * (ranks // dims.ep if is_expert(param) else ranks)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel * dtype.itemsize


def _checkpoint_bytes(job: TrainingJob, optimizer_state: dict) -> int:
    """Bytes this rank writes in a checkpoint of the model and optimizer, from DCP's own save plan (which also
    rejects a state it could not save or reshard, as a real save would)."""
    model = {}
    for part in job.model.parts:
        model.update(part.state_dict())
    planner = DefaultSavePlanner()
    planner.set_up_planner({"model": model, "optimizer": optimizer_state}, is_coordinator=dist.get_rank() == 0)
    plan = planner.create_local_plan()
    return sum(
        item.tensor_data.size.numel() * item.tensor_data.properties.dtype.itemsize
        for item in plan.items
        if item.tensor_data is not None
    )


def memory_table(results: list[RankMemory], hardware: Hardware) -> str:
    """One row per rank, in GiB, then the GPU's usable memory."""
    columns = ("params", "grads", "optim", "activ", "opt step", "total")
    rows = [f"{'rank':>6} {'pp':>4} {'dp':>4} {'tp':>4} " + " ".join(f"{name:>9}" for name in columns)]
    for r in results:
        parts = (r.param_bytes, r.grad_bytes, r.optimizer_state_bytes, r.activation_bytes, r.optimizer_step_bytes,
                 r.total_bytes)  # fmt: skip
        rows.append(f"{r.rank:>6} {r.pp:>4} {r.dp:>4} {r.tp:>4} " + " ".join(f"{b / GiB:>9.2f}" for b in parts))
    busiest = max(results, key=lambda r: r.total_bytes)
    reserved = reserved_bytes(busiest.total_bytes) / GiB
    rows.append(
        "GiB per rank; total = params + grads + optim + the larger of activ (backward's peak) and opt step (the "
        "optimizer step's buffers)"
    )
    rows.append(
        f"a GPU run's peak (the CUDA caching allocator's reserved segments) is more than its tensors: about "
        f"{reserved:.2f} GiB on rank {busiest.rank} (total x {1 + FRAGMENTATION:.2f}: torchpre/planner/allocator.py), "
        f"against the {hardware.allocator_bytes / GiB:.2f} GiB {hardware.name} leaves the allocator"
    )
    return "\n".join(rows)


def check_fits(results: list[RankMemory], hardware: Hardware) -> None:
    """Raises DoesNotFit for the rank that needs the most memory, if its allocator peak (what a GPU run reports) is
    more than the GPU leaves the allocator."""
    worst = max(results, key=lambda r: r.total_bytes)
    reserved = reserved_bytes(worst.total_bytes)
    if reserved <= hardware.allocator_bytes:
        return
    parts = {
        "parameters": worst.param_bytes,
        "gradients": worst.grad_bytes,
        "optimizer state": worst.optimizer_state_bytes,
        "activations": worst.activation_bytes,
    }
    largest = max(parts, key=parts.get)
    listed = ", ".join(f"{name} {size / GiB:.2f}" for name, size in parts.items())
    raise DoesNotFit(
        f"rank {worst.rank} (pp {worst.pp}, dp {worst.dp}, tp {worst.tp}) needs {reserved / GiB:.2f} GiB of the CUDA "
        f"allocator ({worst.total_bytes / GiB:.2f} GiB of tensors: {listed}), more than the "
        f"{hardware.allocator_bytes / GiB:.2f} GiB job.dry_run_gpu = {hardware.name} leaves it; the largest part "
        f"is its {largest}. Shard more: a higher optimizer.zero_stage or data-parallel degree, more tensor or "
        "pipeline parallelism, activation_checkpoint.mode = full, or a smaller training.local_batch_size."
    )
