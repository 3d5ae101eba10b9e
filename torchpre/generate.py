"""Text generation from a training checkpoint, under any tensor/pipeline-parallel layout.

    torchrun --nproc_per_node=N -m torchpre.generate --job.config_file X.toml \\
        --checkpoint.folder DIR [--checkpoint.load_step S] --prompt "..." \\
        [--max_new_tokens K --temperature T --top_k K --seed S] [--json]

The flags are `GenerateConfig`: the job's options (of which generation reads job.*, model.*,
training.mixed_precision_param, parallelism.* and checkpoint.folder/load_step/allow_unverified) plus the
generation flags, parsed, checked and listed by --help like training's. The model is built by the trainer's
code (`torchpre.assembly`, then `torchpre.parallel.parallelize`) with the training-only options off (sequence and
loss parallelism, activation checkpointing, compile), and DCP reshards the checkpoint into it. Decoding uses
the model's KV caches: one forward over the prompt, then one token at a time, each through
`ParallelModel.forward_only`. Under pipeline parallelism that passes the hidden states stage to stage
with point-to-point sends; the last stage samples and broadcasts the token to every stage. Tensor-parallel
ranks see the same full logits and sample with identically seeded generators, so they agree without
communicating. Ranks left over by tp x pp (data-parallel replicas, e.g. `--nproc_per_node=2` with no TP/PP)
each decode the same sequence on their own pipeline; rank 0 prints it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from torchpre.assembly.args import model_args, model_context
from torchpre.assembly.layout_checks import check_layout
from torchpre.assembly.meta import meta_model
from torchpre.assembly.plans import parallel_plan
from torchpre.assembly.rope import check_saved_rope
from torchpre.assembly.tokenizer import job_tokenizer
from torchpre.assembly.weights import Resume
from torchpre.checkpoint.folders import STEP_DIR, find_step_dir
from torchpre.checkpoint.integrity import FileCheck, Trust, find_intact_step, require_intact
from torchpre.checkpoint.reader import Loader
from torchpre.checkpoint.run import resume_trust
from torchpre.checkpoint.state import check_shapes, checkpoint_metadata
from torchpre.config.bounds import Bound, at_least, check_bounds
from torchpre.config.job_config import JobConfig
from torchpre.config.parser import parse_args
from torchpre.config.validate import check_section_bounds
from torchpre.confined import file_kind
from torchpre.data.tokenizer import Tokenizer
from torchpre.distributed.parallel_dims import ParallelDims
from torchpre.distributed.process_groups import init_distributed, select_device, world_size_from_env
from torchpre.errors import ConfigError, TorchpreError
from torchpre.models.args import ModelArgs
from torchpre.models.registry import ModelSpec, get_model_spec
from torchpre.parallel.api import ParallelModel, ParallelPlan, parallelize
from torchpre.parallel.pipeline import PipelinePlan, checked_stages_per_rank
from torchpre.runtime.custom_import import import_custom_module
from torchpre.step_rules.schedules import get_schedule


def _flag(default: object, doc: str, bound: Bound | None = None):
    metadata = {"help": doc} if bound is None else {"help": doc, "bound": bound}
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass
class GenerateConfig(JobConfig):
    """A job config plus the generation flags (top-level: --prompt, not --generation.prompt)."""

    prompt: str | None = _flag(None, "text to continue (required)")
    max_new_tokens: int = _flag(32, "most tokens to generate; stops earlier at the end-of-text token", at_least(1))
    temperature: float = _flag(
        0.8, "softmax temperature; 0 = greedy", at_least(0, "use 0 for greedy decoding or a positive value.")
    )
    top_k: int | None = _flag(
        None,
        "sample among the k most likely tokens only; none = all",
        at_least(1, "it must be at least 1 (or none for no top-k filtering).", also=(None,)),
    )
    seed: int = _flag(0, "seed of the sampling generator, the same on every rank")
    json: bool = _flag(False, 'print one JSON line {"prompt", "prompt_token_ids", "completion", "token_ids"}')


def validate_generation_args(gen: GenerateConfig) -> None:
    """The generation flags: a prompt, and each number flag's bound (declared with it); then the job's keys' own
    bounds, as training checks them."""
    if gen.prompt is None:
        raise ConfigError('--prompt is required: the text to continue, e.g. --prompt "def main():"')
    if not gen.prompt:
        raise ConfigError("--prompt is empty: give some text to continue.")
    check_bounds(gen, "--")
    check_section_bounds(gen)


# Checkpoint ------------------------------------------------------------------------------------


def checkpoint_folder(dump_folder: str, folder: str) -> Path:
    """`folder` itself when absolute or existing, else `{dump_folder}/{folder}` (as the trainer saves)."""
    path = Path(folder)
    return path if path.is_absolute() or path.exists() else Path(dump_folder) / folder


def find_generation_step(folder: Path, load_step: int) -> Path:
    """The complete `step-N` folder to load: `load_step`, or the highest one for -1.

    `folder` may also be a `step-N` folder itself (with load_step -1 or N).
    """
    if STEP_DIR.match(folder.name) and file_kind(folder, ".metadata") == "file":
        if load_step in (-1, int(folder.name[5:])):
            return folder
    if not folder.is_dir():
        raise TorchpreError(
            f"The checkpoint folder {folder} does not exist. Set --checkpoint.folder to the folder holding "
            "the step-N checkpoints (absolute, or relative to job.dump_folder as in training)."
        )
    step_dir = find_step_dir(folder, load_step)
    if step_dir is None:
        raise TorchpreError(
            f"The checkpoint folder {folder} holds no complete step-N checkpoint. Point --checkpoint.folder "
            "at a training run's checkpoint folder."
        )
    return step_dir


def check_checkpoint_fits(model: nn.Module, check: FileCheck, allow_pickle: bool = False) -> None:
    """Names the model weights the checked checkpoint lacks or holds with another shape (global shapes)."""
    check_shapes({"model": model.state_dict()}, checkpoint_metadata(check, allow_pickle), check.step_dir)


# Decoding --------------------------------------------------------------------------------------


def sample(logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator) -> int:
    """A token id from logits [vocab]: greedy for temperature 0, else softmax(logits / temperature)
    over the top_k most likely tokens (all when None), drawn from `generator` (a CPU generator)."""
    logits = logits.float().cpu()
    if temperature == 0:
        return int(logits.argmax())
    if top_k is not None and top_k < logits.numel():
        values, indices = torch.topk(logits, top_k)
    else:
        values, indices = logits, None
    probs = torch.softmax(values / temperature, dim=-1)
    choice = int(torch.multinomial(probs, 1, generator=generator))
    return choice if indices is None else int(indices[choice])


def share_token(model: ParallelModel, token: int | None) -> int:
    """The token sampled on the last pipeline stage, on every stage (`token` is None on the others)."""
    if model.plan.pipeline is None:
        return token
    value = torch.tensor([-1 if token is None else token], dtype=torch.long, device=model.device)
    dist.broadcast(value, group=model.mesh["pp"].get_group(), group_src=model.last_stage_rank)
    return int(value.item())


def whole_model(model: nn.Module) -> ParallelModel:
    """A materialised one-process model as a ParallelModel, e.g. to decode a reference."""
    device = next(model.parameters()).device
    return ParallelModel([model], mesh=None, plan=ParallelPlan(), device=device, loss_fn=None, expert_mesh=None)


@torch.no_grad()
def generate_ids(
    model: ParallelModel,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    temperature: float,
    top_k: int | None,
    seed: int,
    eos_id: int | None = None,
) -> list[int]:
    """The generated ids (without the prompt and without the end-of-text token that stops it).

    Every rank of `model` calls this. Models with KV caches (`setup_caches`) are given caches for
    len(prompt_ids) + max_new_tokens positions, reset here; the others recompute the whole sequence per token.
    """
    cached = all(hasattr(part, "setup_caches") for part in model.parts)
    if cached:
        for part in model.parts:
            part.setup_caches(1, len(prompt_ids) + max_new_tokens)
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.tensor([list(prompt_ids)], dtype=torch.long, device=model.device)
    start_pos, generated = 0, []
    for _ in range(max_new_tokens):
        position = {"start_pos": start_pos} if cached else {}
        logits = model.forward_only(tokens, forward_kwargs=lambda inputs: position)
        token = share_token(model, None if logits is None else sample(logits[0, -1], temperature, top_k, generator))
        if token == eos_id:
            break
        generated.append(token)
        new = torch.tensor([[token]], dtype=torch.long, device=model.device)
        if cached:
            start_pos += tokens.shape[1]
            tokens = new
        else:
            tokens = torch.cat([tokens, new], dim=1)
    if cached:
        for part in model.parts:
            part.clear_caches()
    return generated


# Entry point -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DecodingPreflight:
    """What generation derives from its flags before it joins the process group, every check passed: the layout,
    the model (on the meta device, checked against the checkpoint), the prompt, what loads accept (`trust`, the
    signing key read once) and the checkpoint the weights come from (`weights`)."""

    config: GenerateConfig  # the job's config with the training-only options off (`decoding_config`)
    dims: ParallelDims
    tokenizer: Tokenizer
    model: nn.Module
    plan: ParallelPlan
    prompt_ids: list[int]
    folder: Path  # --checkpoint.folder, resolved as training resolves it
    trust: Trust
    weights: Resume


def decoding_preflight(gen: GenerateConfig, world_size: int) -> DecodingPreflight:
    """Everything that can reject the input, identically on every rank. The job's layout must fit the world as
    training's would, context parallelism included (its ranks decode as replicas)."""
    validate_generation_args(gen)
    p = gen.parallelism
    ParallelDims.from_degrees(
        p.data_parallel_degree, p.tensor_parallel_degree, p.pipeline_parallel_degree, world_size,
        cp=p.context_parallel_degree,
    )  # fmt: skip
    config = decoding_config(gen)
    p = config.parallelism
    dims = ParallelDims.from_degrees(p.data_parallel_degree, p.tensor_parallel_degree, p.pipeline_parallel_degree,
                                     world_size)  # fmt: skip
    spec = get_model_spec(config.model.name)
    tokenizer = job_tokenizer(config)
    context = model_context(config, tokenizer)
    prompt_ids = tokenizer.encode(gen.prompt, bos=True, eos=False)
    total = len(prompt_ids) + gen.max_new_tokens
    if total > context:
        raise ConfigError(
            f"The prompt ({len(prompt_ids)} tokens) plus --max_new_tokens {gen.max_new_tokens} exceed the "
            f"model's context of {context} tokens. Shorten the prompt or lower --max_new_tokens."
        )
    # RoPE is computed per position, so sizing it to this generation leaves the values unchanged.
    args = model_args(config, tokenizer, max_seq_len=total)
    check_layout(config, spec, args, dims)
    pipeline = decoding_pipeline(config, spec, args) if dims.pp > 1 else None
    folder = checkpoint_folder(config.job.dump_folder, config.checkpoint.folder)
    step_dir = find_generation_step(folder, config.checkpoint.load_step)
    model = meta_model(config, spec, args)
    trust = _trust(config, folder, step_dir)
    allow_pickle = config.checkpoint.allow_pickle
    check_checkpoint_fits(model, FileCheck(step_dir, trust, "checkpoint.folder"), allow_pickle)
    check_saved_rope(step_dir, args, trust, allow_pickle)
    plan = parallel_plan(config, spec, args, pipeline)
    latest = step_dir.parent == folder and config.checkpoint.load_step == -1
    weights = Resume(step_dir, latest=latest)
    return DecodingPreflight(config, dims, tokenizer, model, plan, prompt_ids, folder, trust, weights)


def load_for_decoding(pre: DecodingPreflight, device: torch.device) -> tuple[ParallelModel, Path]:
    """The parallel model with the checkpoint's weights, in eval mode, and the step folder they came from. The
    manifest check reads every file: the ranks share it, so it waits for the process group."""
    load_step, folder, step_dir = pre.config.checkpoint.load_step, pre.folder, pre.weights.step_dir
    key = "checkpoint.folder" if load_step == -1 else f"checkpoint.load_step = {load_step}"
    allow_pickle = pre.config.checkpoint.allow_pickle
    if pre.weights.latest:  # past corrupt ones, as training resumes: the check waits for the process group
        step_dir = find_intact_step(folder, load_step, pre.trust)
        check = FileCheck(step_dir, pre.trust, key).whole_folder_checked()
        check_checkpoint_fits(pre.model, check, allow_pickle)
    else:
        require_intact(step_dir, key, pre.trust)
        check = FileCheck(step_dir, pre.trust, key).whole_folder_checked()
    # The checkpoint replaces every parameter: only the buffers it does not hold (RoPE's) are computed.
    spec = get_model_spec(pre.config.model.name)
    mesh = pre.dims.build_mesh(device.type)
    parallel = parallelize(pre.model, mesh, pre.plan, device=device, init_weights=spec.build.init_buffers)
    state = {name: value for part in parallel.parts for name, value in part.state_dict().items()}
    Loader(check, allow_pickle).load({"model": state})
    for part in parallel.parts:
        part.eval()
    return parallel, step_dir


def main(argv: list[str]) -> None:
    _progress_to_stderr()
    gen = parse_args(GenerateConfig, argv)
    import_custom_module(gen.job.custom_import)
    pre = decoding_preflight(gen, world_size_from_env())
    device = select_device()
    init_distributed(device)
    parallel, step_dir = load_for_decoding(pre, device)
    is_rank0 = dist.get_rank() == 0
    if is_rank0:
        print(f"loaded {step_dir}; layout tp {pre.dims.tp} x pp {pre.dims.pp}{_replicas(pre.dims)}", file=sys.stderr,
              flush=True)  # fmt: skip
    ids = generate_ids(
        parallel, pre.prompt_ids, gen.max_new_tokens, temperature=gen.temperature, top_k=gen.top_k, seed=gen.seed,
        eos_id=pre.tokenizer.eos_id,
    )  # fmt: skip
    if is_rank0:
        print(_output(gen, pre.prompt_ids, ids, pre.tokenizer.decode(ids)), flush=True)


def _progress_to_stderr() -> None:
    """stdout carries the completion only; progress and warnings go to stderr."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)


def _replicas(dims: ParallelDims) -> str:
    if dims.dp == 1:
        return ""
    return (
        f"; the {dims.dp} data-parallel replicas each decode the same sequence (raise "
        "parallelism.tensor_parallel_degree to split the model instead)"
    )


def _output(gen: GenerateConfig, prompt_ids: list[int], ids: list[int], completion: str) -> str:
    if not gen.json:
        return completion
    record = {"prompt": gen.prompt, "prompt_token_ids": prompt_ids, "completion": completion, "token_ids": ids}
    return json.dumps(record)


def _trust(config: GenerateConfig, folder: Path, step_dir: Path) -> Trust:
    """What the load accepts: the job's [checkpoint] settings; a step chosen among a run's checkpoints (`folder`'s)
    must, under a signing key, be that run's."""
    trust = Trust.from_settings(config.checkpoint)
    return resume_trust(folder, trust) if step_dir.parent == folder else trust


def decoding_config(config: GenerateConfig) -> GenerateConfig:
    """The job's config with the options that only training uses off: decoding feeds one token at a time
    (nothing to shard over the sequence, no loss; a context-parallel job's cp ranks decode as replicas) under
    no_grad (nothing to recompute), in eager mode."""
    p = config.parallelism
    return dataclasses.replace(
        config,
        parallelism=dataclasses.replace(
            p, enable_sequence_parallel=False, enable_loss_parallel=False, context_parallel_degree=1
        ),
        activation_checkpoint=dataclasses.replace(config.activation_checkpoint, mode="none"),
        compile=dataclasses.replace(config.compile, enable=False),
    )


def decoding_pipeline(config: JobConfig, spec: ModelSpec, args: ModelArgs) -> PipelinePlan:
    """The stages of the job's pipeline layout, placed as its schedule places them. Decoding passes one sequence
    stage to stage itself (`ParallelModel.forward_only`), so the schedule's microbatch rules do not apply."""
    p = config.parallelism
    schedule = get_schedule(p.pipeline_parallel_schedule)
    per_rank = checked_stages_per_rank(schedule, p.pipeline_parallel_virtual_stages)
    num_stages = p.pipeline_parallel_degree * per_rank
    stages = spec.pipeline_stages(
        args,
        num_stages,
        p.pipeline_parallel_split_points,
        embedding_layers=p.pipeline_parallel_embedding_layers,
        output_layers=p.pipeline_parallel_output_layers,
    )
    return PipelinePlan(schedule, p.pipeline_parallel_degree, per_rank, n_microbatches=1, stage_modules=stages)


if __name__ == "__main__":
    from torchpre.runtime.cli import run_entry_point

    run_entry_point(main, sys.argv[1:], prog="python -m torchpre.generate")
