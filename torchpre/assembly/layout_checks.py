"""Checks that the model family can run the job's layout, before any process group: bad input stops every rank
with one message that names what to change."""

import fnmatch
import math

from torchpre.config.job_config import JobConfig
from torchpre.distributed.parallel_dims import ParallelDims
from torchpre.errors import ConfigError, resolve_step
from torchpre.models.args import ModelArgs
from torchpre.models.registry import ModelSpec
from torchpre.optional import import_optional
from torchpre.parallel.quantize import DIVISOR


@resolve_step
def check_layout(config: JobConfig, spec: ModelSpec, args: ModelArgs, dims: ParallelDims) -> None:
    """Rejects a layout the model family cannot run, naming what to change, before any work."""
    name, p = config.model.name, config.parallelism
    if dims.tp > 1:
        if spec.parallel.tensor_parallel is None:
            raise ConfigError(
                f"model.name = '{name}' has no tensor-parallel plan (ModelSpec.parallel.tensor_parallel), so "
                "parallelism.tensor_parallel_degree must be 1."
            )
        if isinstance(spec.parallel.tensor_parallel, dict) and (p.enable_sequence_parallel or p.enable_loss_parallel):
            raise ConfigError(
                f"model.name = '{name}' gives its tensor-parallel plan as a fixed dict, which decides the "
                "layouts itself: turn off parallelism.enable_sequence_parallel and enable_loss_parallel, or "
                "give a plan function that takes sequence_parallel and loss_parallel."
            )
        if p.sequence_parallel_save_shard and p.enable_sequence_parallel:
            check_sequence_shard_saving(config, spec)
        spec.parallel.validate_tensor_parallel(args, dims.tp)
    if dims.ep > 1:
        if spec.parallel.expert_parallel is None:
            raise ConfigError(
                f"model.name = '{name}' has no experts to shard (ModelSpec.parallel.expert_parallel), so "
                "parallelism.expert_parallel_degree must be 1. Use model.name = 'moe' for a Mixture of Experts."
            )
        spec.parallel.validate_expert_parallel(args, dims.ep)
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
    if config.activation_checkpoint.recompute_mlp_activation:
        check_mlp_activation_recompute(config, spec)
    seq_len, cp = config.training.seq_len, dims.cp
    tokens_key = "training.seq_len" + (f" / parallelism.context_parallel_degree {cp}" if cp > 1 else "")
    q = config.quantize
    check_quantize(q.linear, q.recipe, seq_len // cp, tokens_key)
    if q.experts:
        matmul_dims = None if spec.parallel.expert_matmul_dims is None else spec.parallel.expert_matmul_dims(args, dims)
        check_quantize_experts(q.linear, name, matmul_dims)
    spec.parallel.validate_layout(args, dims)


def check_sequence_shard_saving(config: JobConfig, spec: ModelSpec) -> None:
    """parallelism.sequence_parallel_save_shard needs the family's plan for it, and eager blocks: it runs as
    saved-tensor hooks around each attention and feed-forward (`torchpre.parallel.sequence_gather`), which
    torch.compile cannot trace."""
    if not spec.parallel.saves_sequence_shard:
        raise ConfigError(
            f"parallelism.sequence_parallel_save_shard: model.name = '{config.model.name}' has no plan that saves "
            "the sequence shard for backward (ModelSpec.parallel.saves_sequence_shard; the families llama3, moe and "
            "deepseek_v3 have one). Turn the key off."
        )
    if config.compile.enable:
        raise ConfigError(
            "parallelism.sequence_parallel_save_shard runs as saved-tensor hooks around each attention and "
            "feed-forward, which torch.compile cannot trace: turn off compile.enable, or the key (a compiled block "
            "saves what its partitioner chooses)."
        )


def check_mlp_activation_recompute(config: JobConfig, spec: ModelSpec) -> None:
    """activation_checkpoint.recompute_mlp_activation needs the family's dense MLPs, and eager blocks that no other
    saved-tensor hooks wrap: it runs as hooks around each MLP (`torchpre.parallel.mlp_activation`)."""
    key, name = "activation_checkpoint.recompute_mlp_activation", config.model.name
    mode = config.activation_checkpoint.mode
    if spec.parallel.recompute_mlp_activation is None:
        raise ConfigError(
            f"{key}: model.name = '{name}' has no dense MLP whose activation it can recompute "
            "(ModelSpec.parallel.recompute_mlp_activation; the family llama3 has one; moe's and deepseek_v3's expert "
            "MLPs are not covered). Turn the key off."
        )
    if mode != "none":
        raise ConfigError(
            f"{key} with activation_checkpoint.mode = '{mode}': the checkpointed blocks recompute their activations "
            "already, and the key's saved-tensor hooks would not nest inside checkpointing's. Set "
            "activation_checkpoint.mode = 'none', or turn the key off."
        )
    if config.compile.enable:
        raise ConfigError(
            f"{key} runs as saved-tensor hooks around each MLP, which torch.compile cannot trace (a compiled block "
            "saves what its partitioner chooses): turn off compile.enable, or the key."
        )


def check_context_parallel(config: JobConfig, spec: ModelSpec, dims: ParallelDims) -> None:
    """Rejects what parallelism.context_parallel_degree cannot run, naming it, before any work."""
    name, cp, seq_len = config.model.name, dims.cp, config.training.seq_len
    key = f"parallelism.context_parallel_degree = {cp}"
    if spec.parallel.context_parallel is None:
        raise ConfigError(
            f"{key}: model.name = '{name}' has no context-parallel attention (ModelSpec.parallel.context_parallel), so "
            "its attention cannot be split over the sequence. Set context_parallel_degree = 1, or use a family that "
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
    if spec.build.output_layer is None:
        raise ConfigError(
            f"{key}: model.name = '{name}' names no output layer that the chunked loss can replace "
            "(ModelSpec.build.output_layer). Set training.loss_chunk_size = 0, or use a family that has one (llama3, "
            "moe, deepseek_v3)."
        )
    if q.linear != "none" and any(fnmatch.fnmatchcase(spec.build.output_layer, pattern) for pattern in q.modules):
        raise ConfigError(
            f"{key} with quantize.linear = '{q.linear}' and quantize.modules = {list(q.modules)}, which names the "
            f"output layer '{spec.build.output_layer}': the chunked loss computes that layer's matmuls itself, in the "
            "parameters' dtype. Leave it out of quantize.modules, or set training.loss_chunk_size = 0."
        )


def check_quantize(linear: str, recipe: str, tokens_per_row: int, tokens_key: str) -> None:
    """Refuses, naming the keys, what the chosen format cannot do with the sequences a rank sees (the [quantize]
    keys' own combinations are `torchpre.config.validate`'s); run on every rank before any process group.
    `tokens_per_row` is how many positions of a sequence one rank's matmuls see (`tokens_key` says which keys
    set it): MXFP8's weight gradient scales blocks of 32 of them."""
    if linear == "none":
        return
    import_optional("torchao", f"quantize.linear = '{linear}'", extra="fp8")  # missing: names the extra
    if linear != "mxfp8":
        return
    if recipe == "rowwise" and tokens_per_row % DIVISOR["mxfp8"]:
        raise ConfigError(
            f"quantize.linear = 'mxfp8' with quantize.recipe = 'rowwise' and {tokens_key} = {tokens_per_row} "
            "positions per sequence on each rank: its weight gradient scales blocks of 32 tokens of a microbatch, "
            "which every microbatch has whole when the positions are a multiple of 32. Change training.seq_len, or "
            "use quantize.recipe = 'rowwise_with_gw_hp' (weight gradients in high precision)."
        )


def check_quantize_experts(linear: str, family: str, matmul_dims: dict[str, int] | None) -> None:
    """Refuses what `quantize.experts` cannot run, naming the keys, on every rank before any process group.
    `matmul_dims` names the dimensions each rank's expert matmuls multiply (None: the family has no routed experts)."""
    key = "quantize.experts"
    if matmul_dims is None:
        raise ConfigError(
            f"{key} with model.name = '{family}': that family has no routed experts whose grouped matmuls torchpre "
            f"can swap (ModelSpec.parallel.set_grouped_mm). Turn {key} off, or use model.name = 'moe' or 'deepseek_v3'."
        )
    if linear == "none":
        raise ConfigError(
            f"{key} with quantize.linear = 'none': the experts take quantize.linear's format. Set quantize.linear = "
            f"'mxfp8', or turn {key} off."
        )
    if linear == "float8":
        raise ConfigError(
            f"{key} with quantize.linear = 'float8': torchao's float8 grouped matmul (rowwise only) runs on triton "
            "kernels on CUDA GPUs, with no emulation, and torchpre does not build it. Use quantize.linear = 'mxfp8' "
            f"(emulated on CPU; kernels on compute capability 10.0), or turn {key} off (the experts stay in high "
            "precision, the other linears in float8)."
        )
    divisor = DIVISOR[linear]
    uneven = {name: size for name, size in matmul_dims.items() if size % divisor}
    if uneven:
        sizes = ", ".join(f"{name} = {size}" for name, size in uneven.items())
        raise ConfigError(
            f"{key} with quantize.linear = '{linear}': the experts' matmuls scale blocks of {divisor} values along "
            f"every dimension, and each rank's experts have {sizes}. Use a flavor whose expert dimensions are "
            f"multiples of {divisor} on every rank, or turn {key} off."
        )
