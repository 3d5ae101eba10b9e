"""The job's model, built one way for training, validation, generation and conversion.

Each entry point derives the model's args from the job config and the tokenizer, checks that the model family
can run the layout (before any process group, so bad input stops every rank with one message), builds the
plain model on the meta device in the parameter dtype, and hands it to `torchpre.parallel.parallelize` with the
`ParallelPlan` made here. A second copy of any of these steps is how generation and training drifted apart.
"""

import contextlib
import dataclasses
import fnmatch
import functools
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchpre.config.job_config import JobConfig
from torchpre.confined import file_kind, located
from torchpre.data.hf_tokenizer import TOKENIZER_JSON
from torchpre.data.tokenizer import DEFAULT_TOKENIZER_PATH, Tokenizer, load_tokenizer
from torchpre.distributed.parallel_dims import ParallelDims
from torchpre.errors import ConfigError
from torchpre.interchange.load import FROM_HF, folder_args
from torchpre.interchange.reader import is_hf_folder
from torchpre.models.registry import ModelSpec, get_flavor, get_model_spec
from torchpre.parallel.api import ParallelPlan
from torchpre.parallel.context_parallel import ContextParallel
from torchpre.parallel.data_parallel import DataParallel, FSDPPlan
from torchpre.parallel.pipeline import PipelinePlan
from torchpre.parallel.quantize import QuantizePlan, check_quantize, resolve_emulate
from torchpre.parallel.quantized_experts import check_quantize_experts
from torchpre.training.parametrization import refuse_shape_keys, with_model_shape, with_parametrization
from torchpre.training.rope import refuse_rope_keys, with_rope


def tokenizer_path(config: JobConfig) -> Path:
    """model.tokenizer_path; when empty, the Hugging Face folder's own tokenizer (its tokenizer.json) when
    checkpoint.initial_load_path is a folder that has one (the model it releases is trained on with the ids it was
    made with), else the shipped tiktoken file."""
    if config.model.tokenizer_path:
        return Path(config.model.tokenizer_path)
    folder = Path(config.checkpoint.initial_load_path)
    if config.checkpoint.initial_load_path and is_hf_folder(folder):
        if file_kind(*located(folder, TOKENIZER_JSON)) != "missing":  # a link: read_files refuses it by name
            return folder
    return DEFAULT_TOKENIZER_PATH


def job_tokenizer(config: JobConfig) -> Tokenizer:
    """The job's tokenizer (`tokenizer_path`)."""
    return load_tokenizer(tokenizer_path(config))


def model_args(config: JobConfig, tokenizer: Tokenizer, max_seq_len: int | None = None) -> Any:
    """The flavor's args (model.flavor = 'from_hf': the folder's at checkpoint.initial_load_path) with the job's
    shape (model.dim, n_layers, n_heads, n_kv_heads), vocabulary (`vocab_size`), `max_seq_len` (default:
    training.seq_len), RoPE (model.rope_*, `with_rope`) and parametrization (model.parametrization, relative to the
    same model at its base shape); a family with `args_from_job` (model.name = 'hf') builds its own."""
    seq_len = config.training.seq_len if max_seq_len is None else max_seq_len
    spec, m = get_model_spec(config.model.name), config.model
    if spec.args_from_job is not None:
        if m.vocab_size:
            raise ConfigError(
                f"model.vocab_size = {m.vocab_size} with model.name = '{m.name}': this family takes its vocabulary "
                "from its own config (model.hf_config's vocab_size). Set model.vocab_size = 0."
            )
        refuse_rope_keys(m, "its RoPE comes from its own config, model.hf_config: set it there")
        refuse_shape_keys(m, f"model.name = '{m.name}' takes its shape from model.hf_config: set it there")
        with_mtp(m, None)
        args = spec.args_from_job(config, vocab_size(config, tokenizer), seq_len)
        return with_parametrization(config, spec, args, None, lambda dim, depth: None)
    flavor = flavor_args(config)
    vocabulary = folder_vocab_size(config, tokenizer, flavor) if _from_hf(config) else vocab_size(config, tokenizer)

    def finished(args: Any) -> Any:
        args = with_mtp(m, with_rope(m, args))
        return dataclasses.replace(args, vocab_size=vocabulary, max_seq_len=seq_len)

    def base_at(dim: int, depth: int) -> Any:
        return finished(with_model_shape(m, flavor, dim=dim, n_layers=depth))

    return with_parametrization(config, spec, finished(with_model_shape(m, flavor)), flavor, base_at)


def flavor_args(config: JobConfig) -> Any:
    """The args model.flavor names: a registered flavor's, or with 'from_hf' those of checkpoint.initial_load_path's
    config.json."""
    if not _from_hf(config):
        return get_flavor(config.model.name, config.model.flavor)
    path = Path(config.checkpoint.initial_load_path)
    if not config.checkpoint.initial_load_path or not is_hf_folder(path):
        given = f"'{path}', which is not one" if config.checkpoint.initial_load_path else "unset"
        raise ConfigError(
            f"model.flavor = '{FROM_HF}' reads the model from the Hugging Face folder at checkpoint.initial_load_path "
            f"(config.json and safetensors weights), which is {given}. Set checkpoint.initial_load_path to the folder."
        )
    return folder_args(path, get_model_spec(config.model.name), config.model.name)


def folder_vocab_size(config: JobConfig, tokenizer: Tokenizer, args: Any) -> int:
    """The folder's vocabulary (its embedding's rows), which the tokenizer's ids must fit and model.vocab_size may
    only repeat; the shape keys are refused, as the folder's config.json sets the shape."""
    refuse_shape_keys(config.model, f"model.flavor = '{FROM_HF}' takes the shape of the folder's config.json")
    if config.model.vocab_size not in (0, args.vocab_size):
        raise ConfigError(
            f"model.vocab_size = {config.model.vocab_size} with model.flavor = '{FROM_HF}': the folder's embedding has "
            f"vocab_size = {args.vocab_size} rows. Set model.vocab_size = 0."
        )
    if tokenizer.vocab_size > args.vocab_size:
        raise ConfigError(
            f"The tokenizer {tokenizer.path} (model.tokenizer_path) has {tokenizer.vocab_size} ids, more than the "
            f"{args.vocab_size} rows of the embedding of {config.checkpoint.initial_load_path}. Use the tokenizer the "
            "model was released with."
        )
    return args.vocab_size


def _from_hf(config: JobConfig) -> bool:
    return config.model.flavor == FROM_HF


def with_mtp(model: Any, flavor: Any) -> Any:
    """The flavor with model.mtp_depth and model.mtp_loss_weight, for a family with multi-token prediction."""
    if not hasattr(flavor, "mtp_depth"):
        if model.mtp_depth:
            raise ConfigError(
                f"model.mtp_depth = {model.mtp_depth} with model.name = '{model.name}': multi-token prediction is "
                "built for model.name = 'deepseek_v3'. Set model.mtp_depth = 0."
            )
        return flavor
    return dataclasses.replace(flavor, mtp_depth=model.mtp_depth, mtp_loss_weight=model.mtp_loss_weight)


def vocab_size(config: JobConfig, tokenizer: Tokenizer) -> int:
    """model.vocab_size, or the tokenizer's when it is 0. A vocabulary smaller than the tokenizer's is only for
    random tokens: text would hold ids the embedding has no row for."""
    size = config.model.vocab_size or tokenizer.vocab_size
    texts = [f"{section}.dataset = '{name}'" for section, name in _datasets(config) if name != "synthetic"]
    if size < tokenizer.vocab_size and texts:
        raise ConfigError(
            f"model.vocab_size = {size} is smaller than the tokenizer's {tokenizer.vocab_size} ids "
            f"({tokenizer.path}, model.tokenizer_path), which {texts[0]} holds. Set model.vocab_size = 0 (the "
            f"tokenizer's) or at least {tokenizer.vocab_size}, or train on training.dataset = 'synthetic'."
        )
    return size


def _datasets(config: JobConfig) -> list[tuple[str, str]]:
    """(section, dataset) of every source the job reads tokens from."""
    v = config.validation
    return [("training", config.training.dataset)] + ([("validation", v.dataset)] if v.enable and v.dataset else [])


def model_context(config: JobConfig, tokenizer: Tokenizer) -> int:
    """The longest sequence the model is designed for: its flavor's max_seq_len, or the model's own context."""
    spec = get_model_spec(config.model.name)
    if spec.args_from_job is not None:
        return spec.args_from_job(config, vocab_size(config, tokenizer), None).max_seq_len
    return flavor_args(config).max_seq_len


def check_layout(config: JobConfig, spec: ModelSpec, args: Any, dims: ParallelDims) -> None:
    """Rejects a layout the model family cannot run, naming what to change, before any work."""
    name, p = config.model.name, config.parallelism
    if dims.tp > 1:
        if spec.tensor_parallel is None:
            raise ConfigError(
                f"model.name = '{name}' has no tensor-parallel plan (ModelSpec.tensor_parallel), so "
                "parallelism.tensor_parallel_degree must be 1."
            )
        if isinstance(spec.tensor_parallel, dict) and (p.enable_sequence_parallel or p.enable_loss_parallel):
            raise ConfigError(
                f"model.name = '{name}' gives its tensor-parallel plan as a fixed dict, which decides the "
                "layouts itself: turn off parallelism.enable_sequence_parallel and enable_loss_parallel, or "
                "give a plan function that takes sequence_parallel and loss_parallel."
            )
        spec.validate_tensor_parallel(args, dims.tp)
    if dims.ep > 1:
        if spec.expert_parallel is None:
            raise ConfigError(
                f"model.name = '{name}' has no experts to shard (ModelSpec.expert_parallel), so "
                "parallelism.expert_parallel_degree must be 1. Use model.name = 'moe' for a Mixture of Experts."
            )
        spec.validate_expert_parallel(args, dims.ep)
    if p.enable_sequence_parallel and config.training.seq_len % dims.tp:
        raise ConfigError(
            f"parallelism.enable_sequence_parallel shards the sequence over tensor_parallel_degree = {dims.tp} "
            f"ranks, but training.seq_len = {config.training.seq_len} is not divisible by it. Use a multiple of "
            f"{dims.tp}."
        )
    if dims.cp > 1:
        check_context_parallel(config, spec, dims)
    if config.training.loss_chunk_size:
        check_chunked_loss(config, spec)
    seq_len, cp = config.training.seq_len, dims.cp
    tokens_key = "training.seq_len" + (f" / parallelism.context_parallel_degree {cp}" if cp > 1 else "")
    q = config.quantize
    check_quantize(q.linear, q.recipe, seq_len // cp, tokens_key)
    if q.experts:
        matmul_dims = None if spec.expert_matmul_dims is None else spec.expert_matmul_dims(args, dims)
        check_quantize_experts(q.linear, name, matmul_dims)
    spec.validate_layout(args, dims)


def check_context_parallel(config: JobConfig, spec: ModelSpec, dims: ParallelDims) -> None:
    """Rejects what parallelism.context_parallel_degree cannot run, naming it, before any work."""
    name, cp, seq_len = config.model.name, dims.cp, config.training.seq_len
    key = f"parallelism.context_parallel_degree = {cp}"
    if spec.context_parallel is None:
        raise ConfigError(
            f"{key}: model.name = '{name}' has no context-parallel attention (ModelSpec.context_parallel), so its "
            "attention cannot be split over the sequence. Set context_parallel_degree = 1, or use a family that "
            "has it (llama3, moe)."
        )
    if seq_len % (2 * cp):
        raise ConfigError(
            f"{key}: training.seq_len = {seq_len} is not divisible by 2 x {cp} = {2 * cp}. Head-tail load balancing "
            f"cuts each sequence into 2 x cp equal chunks; use a multiple of {2 * cp}."
        )
    if config.parallelism.enable_sequence_parallel and (seq_len // cp) % dims.tp:
        raise ConfigError(
            f"{key} with parallelism.enable_sequence_parallel: each cp rank's {seq_len // cp} positions are sharded "
            f"again over tensor_parallel_degree = {dims.tp}, which does not divide them. Use a training.seq_len that "
            f"is a multiple of {math.lcm(2 * cp, cp * dims.tp)}."
        )


def check_chunked_loss(config: JobConfig, spec: ModelSpec) -> None:
    """Rejects what training.loss_chunk_size cannot run: a family that names no output layer to replace, and an
    output layer that quantize.modules asks to convert (the chunked loss runs its matmuls itself)."""
    key, name, q = f"training.loss_chunk_size = {config.training.loss_chunk_size}", config.model.name, config.quantize
    if spec.output_layer is None:
        raise ConfigError(
            f"{key}: model.name = '{name}' names no output layer that the chunked loss can replace "
            "(ModelSpec.output_layer). Set training.loss_chunk_size = 0, or use a family that has one (llama3, moe, "
            "deepseek_v3)."
        )
    if q.linear != "none" and any(fnmatch.fnmatchcase(spec.output_layer, pattern) for pattern in q.modules):
        raise ConfigError(
            f"{key} with quantize.linear = '{q.linear}' and quantize.modules = {list(q.modules)}, which names the "
            f"output layer '{spec.output_layer}': the chunked loss computes that layer's matmuls itself, in the "
            "parameters' dtype. Leave it out of quantize.modules, or set training.loss_chunk_size = 0."
        )


def meta_model(config: JobConfig, spec: ModelSpec, args: Any, *, fp32: bool = False) -> nn.Module:
    """The whole plain model on the meta device, its parameters in training.mixed_precision_param; in fp32 with
    `fp32` (training with sharded parameters: FSDP's sharded fp32 parameters are the optimizer's masters, and its
    mixed precision policy casts them to the compute dtype)."""
    dtype = torch.float32 if fp32 else getattr(torch, config.training.mixed_precision_param)
    with torch.device("meta"), _default_dtype(dtype):
        return spec.model_cls(args)


def quantize_plan(config: JobConfig, device: torch.device, blocks: str) -> QuantizePlan:
    """The quantize section as `torchpre.parallel.quantize.convert_linears` takes it: by default the linears inside
    `blocks` (the family's block container), emulation resolved for `device` (refused there when asked off on a
    device without the kernels)."""
    q = config.quantize
    emulate = q.linear != "none" and resolve_emulate(q.linear, q.emulate, device)
    modules = tuple(q.modules) or (f"{blocks}.*",)
    return QuantizePlan(q.linear, q.recipe, modules, emulate, q.fsdp_float8_all_gather)


def fsdp_plan(config: JobConfig, pipeline: PipelinePlan | None, data_parallel: DataParallel) -> FSDPPlan:
    """How FSDP2 shards the parameters. Resharding after forward defaults to on without a pipeline (the gathered
    parameters of a block are freed until its backward) and off with one: a stage runs one forward per
    microbatch, and keeping its gathered parameters saves an all-gather per block and microbatch, while
    torch's pipeline stage keeps them through the step's backwards in any case."""
    t, p = config.training, config.parallelism
    reshard = {"always": True, "never": False, "default": pipeline is None}[p.fsdp_reshard_after_forward]
    return FSDPPlan(
        param_dtype=torch.bfloat16 if t.mixed_precision_param == "bfloat16" else None,
        reduce_dtype=data_parallel.reduce_dtype,
        reshard_after_forward=reshard,
        byte_all_gather=config.quantize.fsdp_float8_all_gather,
    )


def parallel_plan(
    config: JobConfig,
    spec: ModelSpec,
    args: Any,
    pipeline: PipelinePlan | None,
    data_parallel: DataParallel | None = None,
    context_parallel: ContextParallel | None = None,
) -> ParallelPlan:
    """What `parallelize` applies for this job: the family's plans and the config's layout options, FSDP when
    `data_parallel` (training's strategy; generation and conversion load any checkpoint unsharded) shards the
    parameters, and the family's context-parallel attention bound to `context_parallel` (training under cp)."""
    p, ac = config.parallelism, config.activation_checkpoint
    tensor_parallel = spec.tensor_parallel
    if callable(tensor_parallel):
        tensor_parallel = functools.partial(
            tensor_parallel,
            sequence_parallel=p.enable_sequence_parallel,
            loss_parallel=p.enable_loss_parallel,
        )
    shards_parameters = data_parallel is not None and data_parallel.shards_parameters
    return ParallelPlan(
        tensor_parallel=tensor_parallel,
        expert_parallel=spec.expert_parallel,
        pipeline=pipeline,
        blocks=spec.blocks_of(args),
        extra_blocks=spec.extra_blocks(args),
        tied_weights=spec.tied_weights(args),
        activation_checkpoint=ac.mode,
        selective_ac_option=ac.selective_ac_option,
        compile=config.compile.enable,
        compile_fullgraph=spec.compile_fullgraph,
        fsdp=fsdp_plan(config, pipeline, data_parallel) if shards_parameters else None,
        context_parallel=None if context_parallel is None else _bind(spec.context_parallel, context_parallel),
    )


def _bind(
    apply: Callable[[nn.Module, ContextParallel], None], context_parallel: ContextParallel
) -> Callable[[nn.Module], None]:
    """`apply(part, context_parallel)` as the one-argument function `ParallelPlan.context_parallel` calls."""
    return lambda part: apply(part, context_parallel)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Parameters created inside get `dtype`; buffers computed in an explicit dtype (RoPE) keep theirs."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
