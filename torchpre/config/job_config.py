"""Every option of a training job, grouped in TOML sections (names follow torchtitan's)."""

from dataclasses import dataclass, field
from typing import Literal

from torchpre.config.bounds import Bound, at_least, between, positive
from torchpre.step_rules.schedules import SCHEDULE_NAMES, aliases_text, names_where

# What a collective's timeout means, for the message that refuses one.
TIMEOUT = "it must be a positive number (seconds a rank waits for a peer before failing)."

HELD_OUT = (
    "the fraction of the training samples held out for validation must be in (0, 1), leaving both validation and "
    "training data."
)


def _option(default, doc: str, bound: Bound | None = None):
    """A key: its default, its one-line help, and the values it accepts (`torchpre.config.bounds`)."""
    metadata = {"help": doc} if bound is None else {"help": doc, "bound": bound}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class Job:
    """Where the run writes, what it imports first, and the full-world-size dry run."""

    config_file: str = _option("", "TOML file with the job's options; command-line flags override it")
    dump_folder: str = _option("./outputs", "folder for metrics.jsonl, config.toml and checkpoints")
    description: str = _option("", "free text describing the job, saved with its config")
    custom_import: str = _option(
        "",
        "a module (examples.custom_model) or .py file imported before the job is checked, e.g. one that calls "
        "torchpre.models.registry.register_model",
    )
    dry_run: bool = _option(
        False,
        "build the job for ranks of its full world in one process (torch's fake process group, model on the meta "
        "device), print each rank's memory and exit: 0 if it fits job.dry_run_gpu, 2 if not; nothing is trained "
        "or written",
    )
    dry_run_world_size: int = _option(
        0, "the world size a dry run builds; 0 = the product of the parallelism degrees (needed when dp is -1)"
    )
    dry_run_rank: list[int] = _option(
        [], "global ranks a dry run builds; empty = rank (dp 0, tp 0) of every pipeline stage"
    )
    dry_run_gpu: str = _option(
        "h100-80gb",
        "the GPU whose memory a dry run checks against: h100-80gb, h200-141gb, a100-80gb, h100-96gb-hbm2e-500w or a "
        "profile JSON",
    )


_SHAPE = at_least(0, "it must be positive (0 = the flavor's).")
_MUP_BASE = at_least(0, "it must be positive (0 = the default).")
_MULTIPLIER = positive("a multiplier must be positive.")


@dataclass
class Model:
    """The model family and size, its tokenizer and vocabulary."""

    name: str = _option("llama3", "model family from the model registry")
    flavor: str = _option(
        "debugmodel",
        "model size within the family (debugmodel, 1B, 3B, 8B, 70B, 405B); from_hf: the config.json of the Hugging "
        "Face folder at checkpoint.initial_load_path (llama3, deepseek_v3)",
    )
    tokenizer_path: str = _option(
        "",
        "a Hugging Face tokenizer.json or the folder holding it (with its tokenizer_config.json), or a tiktoken BPE "
        "file (Llama 3's original/tokenizer.model); empty = the tokenizer.json of the Hugging Face folder at "
        "checkpoint.initial_load_path if it has one, else the shipped tiktoken file",
    )
    hf_config: str = _option(
        "",
        "with model.name = 'hf': a transformers config.json (or its folder) of any decoder-only causal LM of the "
        "installed transformers (docs/hf-models.md: what each layout does with it); model.flavor is then not used",
    )
    vocab_size: int = _option(
        0,
        "the model's vocabulary (embedding and output rows); 0 = the tokenizer's; with a text dataset it must hold "
        "every token id (e.g. 128256, Llama 3's, with training.dataset = 'synthetic')",
        at_least(0),
    )
    mtp_depth: int = _option(
        0,
        "multi-token prediction depths after the model (model.name = 'deepseek_v3'; DeepSeek-V3 has 1): depth k also "
        "predicts the token k + 1 ahead, its loss logged as loss/mtp_k; 0 = none (docs/deepseek-v3.md)",
    )
    mtp_loss_weight: float = _option(
        0.3,
        "with model.mtp_depth: the MTP losses' weight in the training loss, over their mean (DeepSeek-V3: 0.3, "
        "then 0.1)",
    )
    # The shape on top of the flavor, so that a width or depth sweep needs no Python (docs/mup.md).
    dim: int = _option(
        0, "model width; 0 = the flavor's. The feed-forward (and MoE, latent) widths follow it as the flavor's do",
        _SHAPE,
    )
    n_layers: int = _option(0, "number of blocks; 0 = the flavor's", _SHAPE)
    n_heads: int = _option(0, "attention heads; 0 = the flavor's", _SHAPE)
    n_kv_heads: int = _option(0, "key/value heads (grouped-query attention); 0 = the flavor's", _SHAPE)
    mlp: Literal["", "swiglu", "gelu", "gelu_tanh"] = _option(
        "",
        "the feed-forward of llama3's blocks: swiglu (Llama's gated w2(silu(w1 x) * w3 x), 2/3 of 4 x dim wide), "
        "gelu (GPT's and MPT's w2(gelu(w1 x)), 4 x dim wide, exact GELU) or gelu_tanh (GELU's tanh approximation, "
        "GPT-2's and Megatron-LM's fused bias-GELU); empty = the flavor's (swiglu); the width follows "
        "ffn_dim_multiplier and multiple_of as the flavor sets them. The GELUs have no Hugging Face Llama folder to "
        "load, export or convert to",
    )
    # Hyperparameter transfer across width and depth (docs/mup.md): multipliers and per-parameter learning rates
    # relative to a base shape at which the model is the standard one.
    parametrization: Literal["sp", "mup", "complete_p"] = _option(
        "sp",
        "sp: the standard parametrization; mup: maximal update (init, per-parameter learning rates, attention 1/d and "
        "the logit multiplier scale with the width over model.mup_base_dim); complete_p: mup and residual branches "
        "scaled by model.mup_base_depth / n_layers",
    )
    mup_base_dim: int = _option(
        0, "mup, complete_p: the width the hyperparameters were tuned at; 0 = the flavor's dim", _MUP_BASE
    )
    mup_base_depth: int = _option(
        0, "complete_p: the depth the hyperparameters were tuned at; 0 = the flavor's n_layers", _MUP_BASE
    )
    mup_base_head_dim: int = _option(
        0,
        "mup, complete_p: the attention head size at the base width; 0 = mup_base_dim / n_heads (the base had this "
        "model's heads); set it when the width grows by adding heads",
        _MUP_BASE,
    )
    mup_embedding_multiplier: float = _option(
        1.0, "mup, complete_p: the embedding's output multiplier (tuned at the base; it does not scale with width)",
        _MULTIPLIER,
    )
    mup_logit_multiplier: float = _option(
        1.0, "mup, complete_p: the logit multiplier at the base width; the logits are multiplied by it x base / dim",
        _MULTIPLIER,
    )
    # RoPE for the families built on Llama 3's args (llama3, moe); a family that reads its RoPE elsewhere (hf) refuses
    # them. A change on resume is a stated stage change (docs/context-parallel.md, "Context extension").
    rope_theta: float = _option(
        0.0, "RoPE base; 0 = the flavor's (500000 for Llama 3)",
        at_least(0, "the RoPE base must be positive (0 = the flavor's)."),
    )
    rope_scaling_factor: float = _option(
        0.0,
        "Llama 3.1-style RoPE scaling: divide the long-wavelength frequencies by this; 0 = the flavor's (1B-405B "
        "have it, debugmodel/tiny not), 1 = no scaling",
        at_least(1, "it divides the long-wavelength frequencies, so it must be at least 1 (1 = no scaling, 0 = the "
                 "flavor's).", also=(0,)),
    )
    rope_low_freq_factor: float = _option(
        0.0, "Llama 3.1 scaling: wavelengths above original_max_seq_len / this are scaled fully; 0 = the flavor's, or 1"
    )
    rope_high_freq_factor: float = _option(
        0.0, "Llama 3.1 scaling: wavelengths below original_max_seq_len / this are kept; 0 = the flavor's, or 4"
    )
    rope_original_max_seq_len: int = _option(
        0,
        "Llama 3.1 scaling: the context the unscaled frequencies were trained on; 0 = the flavor's (needed when "
        "rope_scaling_factor turns scaling on for a flavor without it, e.g. the previous stage's training.seq_len)",
    )


@dataclass
class DataStage:
    """One data stage (a `[[training.data_stages]]` table): training reads its data at its seq_len."""

    name: str = _option("", "a name for logs and metrics (default: stage-N)")
    start_step: int | None = _option(None, "the first step (0-based optimizer steps taken) of this stage")
    start_fraction: float | None = _option(None, "the first step as a fraction of training.steps, in [0, 1)")
    start_at_decay: bool = _option(False, "start where the LR schedule's decay starts (the WSD annealing stage)")
    mixture: dict[str, float] = _option(
        {}, "shard folders and their weights, as training.dataset_mixture; empty = the job's data (training.dataset*)"
    )
    seq_len: int = _option(0, "tokens per sequence in this stage; 0 = training.seq_len")


@dataclass
class Training:
    """Data, batch sizes, sequence length, steps, precision and the step's health checks."""

    dataset: Literal["stdlib", "text", "shards", "synthetic"] = _option(
        "stdlib",
        "'stdlib': docstrings and comments of Python's standard library; 'text': training.dataset_path; "
        "'shards': pre-tokenized shards (training.dataset_path or training.dataset_mixture); 'synthetic': "
        "uniformly random tokens in [0, model.vocab_size), seeded by training.seed (for benchmarks)",
    )
    dataset_path: str = _option(
        "", "'text': a .txt or .jsonl file, or a folder of them; 'shards': a folder written by torchpre.data.prepare"
    )
    dataset_mixture: dict[str, float] = _option(
        {},
        "with training.dataset = 'shards': shard folders and their weights (normalised), e.g. TOML "
        '{ "/data/web" = 0.7, "/data/code" = 0.3 } or --training.dataset_mixture /data/web=0.7,/data/code=0.3',
    )
    num_workers: int = _option(
        0, "data loader worker processes per rank; 0 = read samples in the training process", at_least(0)
    )
    local_batch_size: int = _option(8, "sequences per data-parallel rank per forward/backward", at_least(1))
    global_batch_size: int = _option(
        -1,
        "sequences per optimizer step; -1 = local_batch_size x DP, larger values accumulate gradients",
        at_least(1, "use -1 or a positive number.", also=(-1,)),
    )
    seq_len: int = _option(256, "tokens per sequence", at_least(1))
    batch_rampup: str = _option(
        "",
        "'start,increment,samples': Megatron's --rampup-batch-size; the global batch starts at `start` sequences and "
        "grows by `increment` every samples / ((global_batch_size - start) / increment) sequences until it reaches "
        "training.global_batch_size; empty = no ramp",
    )
    data_stages: list[DataStage] = _option(
        [],
        "[[training.data_stages]] tables, in order: each has start_step, start_fraction or start_at_decay (the first "
        "starts at step 0), and optionally name, mixture (shard folders = weights) and seq_len; see docs/recipes.md",
    )
    global_batch_unit: Literal["sequences", "tokens"] = _option(
        "sequences",
        "what a resume with another training.seq_len keeps of the checkpoint's global batch (with "
        "global_batch_size = -1), and a data stage at another seq_len of the global batch: 'sequences' their number, "
        "'tokens' the tokens per step (the sequences scale by old seq_len / new seq_len)",
    )
    steps: int = _option(100, "optimizer steps to train", at_least(1))
    seed: int = _option(42, "seed of the initial weights and the data order")
    max_norm: float = _option(1.0, "clip the global gradient norm to this value; 0 disables clipping", at_least(0))
    mixed_precision_param: Literal["float32", "bfloat16"] = _option(
        "float32", "dtype of parameters and activations; the optimizer keeps fp32 master weights"
    )
    mixed_precision_grad: Literal["float32", "bfloat16"] = _option(
        "float32", "dtype gradients accumulate in across microbatches (bfloat16 only to measure its error)"
    )
    loss_chunk_size: int = _option(
        0,
        "tokens per chunk of the output layer and cross-entropy: the [tokens, vocabulary] logits are computed a chunk "
        "at a time and never held whole (forward and backward; every layout, multi-token prediction and evaluation "
        "too); 0 = the whole logits at once",
        at_least(0),
    )
    document_mask: bool = _option(
        False,
        "attend only within each document of a packed sequence (a document starts at each BOS token); "
        "RoPE positions stay those of the sequence",
    )
    on_nonfinite: Literal["stop", "skip"] = _option(
        "stop",
        "a step whose loss or gradient norm is NaN/inf is never applied; 'stop': save the last good state "
        "(if checkpoint.enable) and exit with an error; 'skip': drop the step, count it, and train on",
    )
    nonfinite_forensics: int = _option(
        1,
        "replay the first N non-finite steps with a check on every module to name where the NaN/inf started "
        "(module, forward or backward, rank, samples; logged and in metrics.jsonl as nonfinite/*); each replay "
        "costs one step's compute; 0 = off",
        at_least(0),
    )
    spike_zscore: float = _option(
        0.0,
        "warn about a loss this many standard deviations above the mean of the last spike_window; 0 = off",
        at_least(0),
    )
    spike_window: int = _option(100, "recent losses the spike detector compares each loss with", at_least(2))
    gc_freq: int = _option(
        50,
        "Python's automatic garbage collection is off during training and every rank collects (generation 1) "
        "every this many steps, all at the same step; 0 = leave the garbage collector alone",
        at_least(0),
    )
    deterministic: bool = _option(
        False,
        "bitwise-reproducible reruns on the same layout: seed every RNG, use only deterministic kernels "
        "(slower on GPU)",
    )
    tf32: bool = _option(
        True,
        "on CUDA, fp32 matmuls use TF32 tensor cores (torch's float32 matmul precision 'high'; bf16 and CPU runs "
        "are unaffected); false keeps full fp32 ('highest')",
    )


# The rows `torchpre.optim.registry` ships, named here for --help, which answers before torch (and so the registry)
# loads; tests/unit/test_optimizer_registry.py keeps the two equal. The defaults below are the registry's too.
BUILT_IN_OPTIMIZERS = ("AdamW", "Adam", "SGD", "Adagrad", "RMSprop", "Muon")


@dataclass
class Optimizer:
    """The optimizer by name, its hyperparameters, the ZeRO stage and gradient reduction. These defaults are
    `torchpre.optim.build_optimizer`'s too."""

    name: str = _option(
        "AdamW",
        f"an optimizer from torchpre.optim.registry: {', '.join(BUILT_IN_OPTIMIZERS)} (Muon for the hidden "
        "matrices, AdamW for the rest, whole matrices under every layout), or one a job.custom_import registers; a "
        "key below that it does not read must stay at its default",
    )
    lr: float = _option(8e-4, "peak learning rate", positive("the learning rate must be positive."))
    eps: float = _option(1e-8, "term added to the denominator (AdamW, Adam, Adagrad, RMSprop)")
    weight_decay: float = _option(
        0.1, "weight decay of matrices (decoupled for AdamW, an L2 gradient term for the others); never of norm gains"
    )
    beta1: float = _option(0.9, "first-moment decay (AdamW, Adam)", between(0, 1, high_open=True))
    beta2: float = _option(0.95, "second-moment decay (AdamW, Adam)", between(0, 1, high_open=True))
    momentum: float = _option(0.0, "momentum (SGD, RMSprop); 0 = none", at_least(0, "it must be >= 0."))
    muon_momentum: float = _option(0.95, "Muon: momentum of the hidden matrices' gradients")
    muon_nesterov: bool = _option(True, "Muon: Nesterov momentum (the update looks ahead along the momentum)")
    muon_ns_steps: int = _option(5, "Muon: Newton-Schulz iterations of each orthogonalisation")
    muon_ns_coefficients: list[float] = _option(
        [3.4445, -4.775, 2.0315], "Muon: the quintic Newton-Schulz coefficients a, b, c (Keller Jordan's)"
    )
    muon_ns_dtype: Literal["bfloat16", "float32"] = _option(
        "bfloat16", "Muon: dtype the Newton-Schulz iteration runs in (float32 for exact parity across layouts)"
    )
    muon_lr_adjust: Literal["match_rms_adamw", "original", "spectral_unclamped", "none"] = _option(
        "match_rms_adamw",
        "Muon: learning-rate factor per matrix (rows x cols): match_rms_adamw = 0.2*sqrt(max(rows, cols)), so that "
        "AdamW's lr and weight decay carry over (Moonlight); original = sqrt(max(1, rows/cols)); as torch.optim.Muon",
    )
    muon_adamw_params: list[str] = _option(
        [],
        "Muon: parameter-name patterns (fnmatch) stepped by AdamW besides embeddings, the output layer (any matrix "
        "with a dimension of the vocabulary's size), norms and biases",
    )
    zero_stage: int = _option(
        0,
        "0 = optimizer state replicated over DP; 1 = ZeRO-1, state sharded over DP; 2 = ZeRO-2, gradients sharded "
        "too (reduce-scattered during backward); 3 = ZeRO-3, parameters sharded too, by FSDP2 (torch fully_shard)",
    )
    bucket_size_mb: float = _option(25.0, "size of the flat buffers gradients are reduced in, in MiB", positive())
    reduce_dtype: Literal["float32", "bfloat16"] = _option(
        "float32", "dtype of the data-parallel gradient reduction; bfloat16 halves its traffic and rounds the sum"
    )
    overlap_grad_reduce: bool = _option(
        True,
        "ZeRO 0-2: start each bucket's data-parallel reduction during backward as soon as its gradients are final; "
        "false reduces everything after the last microbatch",
    )
    zero2_accumulate_locally: bool = _option(
        False,
        "ZeRO-2 with gradient accumulation: sum the microbatches in a full fp32 buffer and reduce-scatter once "
        "(ZeRO-1's gradient memory, fewer collectives); false reduce-scatters every microbatch into the fp32 shard",
    )
    implementation: Literal["auto", "fused", "foreach"] = _option(
        "auto",
        "auto = fused kernels on CUDA where the optimizer has them (a non-finite step is then skipped on the device, "
        "its verdict read during the next step), torch's default elsewhere; fused = also on CPU; foreach = never fused",
    )


@dataclass
class LRScheduler:
    """The warmup-stable-decay learning-rate schedule."""

    warmup_steps: int = _option(10, "steps of linear warmup from lr/(warmup_steps+1) to lr", at_least(0))
    decay_ratio: float = _option(
        1.0,
        "fraction of the post-warmup steps spent decaying at the end (warmup-stable-decay); 1.0 = decay right after"
        " warmup",
        between(0, 1),
    )
    decay_type: Literal["linear", "sqrt", "cosine"] = _option("linear", "shape of the decay")
    min_lr_factor: float = _option(0.0, "the lr at the end of the decay, as a fraction of the peak lr", between(0, 1))


@dataclass
class Parallelism:
    """The degrees of data, tensor, pipeline, context and expert parallelism on one DeviceMesh, and the pipeline
    schedule."""

    data_parallel_degree: int = _option(-1, "data-parallel replicas; -1 = world_size / (tp x pp x cp)")
    data_parallel_replicate_degree: int = _option(
        1,
        "HSDP (optimizer.zero_stage = 3): groups that each hold one sharded copy of the model; gradients are "
        "all-reduced across groups",
        at_least(1),
    )
    data_parallel_shard_degree: int = _option(
        -1,
        "ZeRO-3: ranks the parameters are sharded over; -1 = data-parallel degree / replicate degree",
        at_least(1, "use -1 (data-parallel degree / replicate degree) or >= 1.", also=(-1,)),
    )
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = _option(
        "default",
        "ZeRO-3: free gathered parameters after each block's forward (always) or keep them for backward (never); "
        "default = always without pipeline parallelism, never with it",
    )
    fsdp_wrap: Literal["block", "sublayer"] = _option(
        "block",
        "ZeRO-3: the units FSDP2 gathers and frees one at a time: each block, or also each block's attention and "
        "feed-forward (sublayer: about half the gathered parameters at the peak, three collectives per block)",
    )
    tensor_parallel_degree: int = _option(1, "tensor-parallel degree (shards attention heads, MLP and vocabulary)")
    enable_sequence_parallel: bool = _option(
        False, "with tensor parallelism, shard norms and residuals along the sequence (saves activation memory)"
    )
    sequence_parallel_save_shard: bool = _option(
        False,
        "with sequence parallelism, attention and feed-forward save their input's sequence shard for backward and "
        "all-gather it again there, instead of saving the gathered input (Megatron-LM's): tp times less memory for "
        "it, one more all-gather per module in backward",
    )
    enable_loss_parallel: bool = _option(
        False, "with tensor parallelism, compute the loss on vocabulary-sharded logits (never gathers full logits)"
    )
    expert_parallel_degree: int = _option(
        1, "MoE models: data-parallel ranks that split the experts among them and exchange tokens (divides dp)"
    )
    context_parallel_degree: int = _option(
        1,
        "context-parallel degree: ranks that split each sequence (head-tail load balanced) and gather keys and "
        "values in attention; they reduce gradients and shard ZeRO state like data-parallel ranks",
    )
    pipeline_parallel_degree: int = _option(1, "pipeline-parallel degree (ranks that hold consecutive stages)")
    pipeline_parallel_schedule: Literal[SCHEDULE_NAMES] = _option("1F1B", f"pipeline schedule ({aliases_text()})")
    pipeline_parallel_microbatch_size: int = _option(1, "sequences per pipeline microbatch")
    pipeline_parallel_virtual_stages: int = _option(
        1,
        f"stages per rank for {', '.join(names_where(multi_stage=True, placement='loop'))} "
        f"({', '.join(names_where(placement='v'))} always use 2)",
    )
    pipeline_parallel_split_points: list[str] = _option(
        [], "first layer of each stage after the first, e.g. layers.2,layers.4; empty = split evenly"
    )
    pipeline_parallel_embedding_layers: int = _option(
        0,
        "an even split counts the embedding as this many layers of the first stage (1: torchtitan's input weight, "
        "Megatron's account_for_embedding_in_pipeline_split); it may then hold the embedding alone",
        at_least(0),
    )
    pipeline_parallel_output_layers: int = _option(
        0,
        "an even split counts the output (final norm, output layer, loss) as this many layers of the last stage; "
        "it may then hold the output alone",
        at_least(0),
    )


@dataclass
class ActivationCheckpoint:
    """Which activations are recomputed in backward instead of kept."""

    mode: Literal["none", "full", "selective"] = _option(
        "none", "recompute activations in backward: 'full' every block, 'selective' by selective_ac_option"
    )
    selective_ac_option: str = _option(
        "op", "'op': keep matmul and attention outputs, recompute the rest; N: checkpoint every N-th block"
    )
    recompute_mlp_activation: bool = _option(
        False,
        "each dense MLP keeps only its projections' outputs for backward and recomputes its activation there "
        "(SwiGLU: 2 hidden-width tensors kept instead of 4, GELU: 1 instead of 2); with mode = 'none', eager blocks",
    )


@dataclass
class Compile:
    """torch.compile of each block."""

    enable: bool = _option(False, "torch.compile each transformer block (fullgraph) and the loss")


@dataclass
class Quantize:
    """Low-precision matmuls through torchao (`pip install -e ".[fp8]"`); the weights and checkpoints stay in
    high precision."""

    linear: Literal["none", "float8", "mxfp8"] = _option(
        "none",
        "matmuls of the chosen linears in 'float8' (FP8 e4m3, GPUs of compute capability 8.9+) or 'mxfp8' "
        "(a scale per 32 values, 10.0+)",
    )
    recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = _option(
        "rowwise",
        "how FP8 values are scaled: one scale per tensor, per row, or per row with weight gradients in "
        "high precision (mxfp8: rowwise or rowwise_with_gw_hp)",
    )
    modules: list[str] = _option(
        [],
        "fnmatch patterns of the linears to convert (e.g. layers.*.feed_forward.*); empty = every linear in the "
        "model's blocks (llama3: layers.*); the output layer only when a pattern matches it ('output'); linears "
        "whose dimensions the kernels cannot take (not multiples of 16, or 32 for mxfp8) stay in high precision",
    )
    experts: bool = _option(
        False,
        "the routed experts' grouped matmuls (model.name moe, deepseek_v3) in quantize.linear's format too, through "
        "torchao's grouped path: 'mxfp8' only (float8 has no grouped path torchpre builds); off, they stay in high "
        "precision",
    )
    emulate: Literal["auto", "true", "false"] = _option(
        "auto", "emulate the low-precision matmuls: 'auto' = where the device has no kernels for them (every CPU)"
    )
    fsdp_float8_all_gather: bool = _option(
        False,
        "ZeRO-3 (FSDP2) all-gathers the float8 linears' weights in FP8, half of bf16's bytes, scaled by the amax of "
        "the whole weight; needs quantize.linear = 'float8' with recipe 'tensorwise' and optimizer.zero_stage = 3",
    )


# The entries a training job's checkpoint saves (`torchpre.training.job.TrainingJob.checkpoint_components` builds
# exactly these, which tests/unit/test_checkpoint_entries.py checks): the names checkpoint.exclude_from_loading takes.
CHECKPOINT_ENTRIES = ("model", "optimizer", "lr_scheduler", "dataloader", "train", "rng", "health")


@dataclass
class Checkpoint:
    """Saving, resuming, retention, integrity and storage behaviour of DCP checkpoints."""

    enable: bool = _option(False, "save checkpoints and resume from the latest one in the folder")
    folder: str = _option("checkpoint", "checkpoint folder, under job.dump_folder unless absolute")
    interval: int = _option(500, "save every this many steps (and at the last step)", at_least(1))
    keep_latest_k: int = _option(0, "keep only the newest k complete checkpoints; 0 keeps all", at_least(0))
    load_step: int = _option(-1, "step to resume from; -1 = the latest complete checkpoint")
    async_mode: Literal["disabled", "async", "async_process"] = _option(
        "disabled",
        "'async': training waits only while the state is copied (into pinned buffers kept across saves on CUDA), "
        "not while it is written (by a thread), and the checkpoint is published (manifest, rename to step-N) as soon "
        "as the write is done; 'async_process': written by DCP's checkpoint process instead, which does not compete "
        "for the GIL (the copy goes to shared memory)",
    )
    checksums: Literal["write", "off"] = _option(
        "write",
        "'write': the manifest records each file's CRC-32, taken while it is written, and loading checks it; "
        "'off': sizes only (a truncated file is still caught, altered bytes are not)",
    )
    exclude_from_loading: list[str] = _option(
        [], f"parts not to load: {', '.join(CHECKPOINT_ENTRIES)} (e.g. optimizer,dataloader)"
    )
    model_only: bool = _option(False, "save only the model weights (for export); resuming then restarts the rest")
    initial_load_path: str = _option(
        "",
        "a checkpoint step folder (or a hf-to-dcp output), or a Hugging Face folder (config.json, safetensors), whose "
        "weights start a run with no checkpoint yet; each rank reads only the shards it holds",
    )
    save_on_preemption: bool = _option(
        False,
        "on SIGTERM (torchrun forwards it) or SIGUSR1 (multinode.slurm passes Slurm's warning on), finish the step, "
        "save a checkpoint and exit cleanly",
    )
    on_low_space: Literal["warn", "skip"] = _option(
        "warn",
        "before each save, the free space of the folder's file system is compared with the size of the last "
        "checkpoint (or of the state): 'warn' logs a warning and saves anyway (a save that fails stops the job with "
        "exit code 4, its partial folder removed); 'skip' skips the save with an error-level log and trains on",
    )
    allow_unverified: bool = _option(
        False,
        "load a step folder that has no manifest.json (written by another tool or before manifests existed), whose "
        "files cannot be checked for damage, with a warning naming it; off: such a folder is refused",
    )
    allow_pickle: bool = _option(
        False,
        "read a foreign checkpoint's pickled .metadata that the restricted interpreter refuses, and its non-tensor "
        "entries, with full pickle, which runs any code they name: only for a checkpoint from someone you trust "
        "(torchpre's own hold nothing pickled; docs/security.md); off: DCP's records and plain values only",
    )
    signing_key_file: str = _option(
        "",
        "a file holding a secret key: every save signs its manifest (HMAC-SHA256 over each file's SHA-256) and every "
        "load refuses a checkpoint not signed with this key (Hugging Face exports are signed and checked too); "
        "empty: no signing (the CRC-32 integrity check stays)",
    )
    allow_unsigned_hf: bool = _option(
        False,
        "with signing_key_file set, accept an unsigned Hugging Face folder as the weights of "
        "checkpoint.initial_load_path or `convert hf-to-dcp` (a model as released, which no key of yours signed), "
        "with a warning naming it; off: refused",
    )
    memory_interval: int = _option(
        0,
        "every this many steps each rank also snapshots its whole state into checkpoint.memory_folder (host memory "
        "that outlives the process), written in the background; a restart with the same layout resumes from the "
        "newest snapshot step complete on every rank when it is newer than the disk checkpoint; 0 = off",
        at_least(0),
    )
    memory_replicas: int = _option(
        1,
        "1: each snapshot is also kept by a peer rank on another node, from which a rank whose node was replaced "
        "restores (on one node: another rank); 0: no replica",
        between(0, 1, message="it must be 0 (no replica) or 1 (one replica on a peer rank of another node)."),
    )
    memory_folder: str = _option(
        "/dev/shm/torchpre",
        "where each node keeps its ranks' snapshots, in a folder per run id; removed when the run ends normally, and "
        "a full folder turns snapshots off with one warning",
    )


@dataclass
class Comm:
    """Collective timeouts and the NCCL flight recorder."""

    init_timeout_seconds: float = _option(
        900.0,
        "during start-up (rendezvous, model build, checkpoint load, the first step and its compilation), a rank "
        "waiting this long for a peer fails with an error instead of hanging",
        positive(TIMEOUT),
    )
    timeout_seconds: float = _option(
        600.0,
        "after the first step, a rank waiting this long for a peer in a collective fails with an error instead of "
        "hanging; must exceed the longest gap between collectives (a checkpoint save, a validation pass)",
        positive(TIMEOUT),
    )
    trace_buf_size: int = _option(
        20000,
        "NCCL flight recorder: the last this many collectives of each rank are recorded and, on a timeout, dumped "
        "to {job.dump_folder}/comm_traces/rank_N (read with torch.distributed.flight_recorder); 0 = off",
        at_least(0),
    )


@dataclass
class Metrics:
    """What each logged step records and where it goes (metrics.jsonl, W&B, TensorBoard)."""

    log_freq: int = _option(10, "log metrics every this many steps (and at the last step)", at_least(1))
    peak_flops: float = _option(
        0.0,
        "peak FLOP/s of one device for MFU; 0 = known GPU table, or a matmul benchmark on CPU",
        at_least(0),
    )
    enable_wandb: bool = _option(
        False, "also log each metrics record to Weights & Biases (run under {job.dump_folder}/wandb; needs wandb)"
    )
    wandb_project: str = _option("torchpre", "W&B project of the run")
    wandb_run_name: str = _option("", "W&B run name; empty = the name W&B picks")
    wandb_entity: str = _option("", "W&B user or team; empty = your default entity")
    enable_tensorboard: bool = _option(
        False, "also write each metrics record as TensorBoard scalars to {job.dump_folder}/tensorboard"
    )
    time_collectives: bool = _option(
        True,
        "time each mesh dimension's collectives (time/comm_*_s) and find stragglers from them; off removes the "
        "wrappers around torch.distributed's collectives that measure them",
    )
    straggler_threshold: float = _option(
        0.2,
        "warn when the ranks' busy time per step (step time less time in collectives) has (max - median) / median "
        "above this for straggler_window log intervals in a row",
        positive(
            "it must be positive (e.g. 0.2: warn when the slowest rank is busy 20% longer per step than the median "
            "rank)."
        ),
    )
    straggler_window: int = _option(
        3, "log intervals the straggler spread must stay above the threshold to warn", at_least(1)
    )


@dataclass
class Profiling:
    """torch.profiler traces of chosen steps."""

    enable_profiling: bool = _option(
        False, "write a torch.profiler trace (and on CUDA a memory snapshot) every profile_freq steps"
    )
    save_traces_folder: str = _option(
        "profile_traces", "traces go to {job.dump_folder}/{save_traces_folder}/step-N/rank{R}_trace.json"
    )
    profile_freq: int = _option(100, "steps between traces; each trace covers the last profile_active of them")
    profile_active: int = _option(1, "steps recorded per trace", at_least(1))


@dataclass
class Validation:
    """A validation loss measured during training."""

    enable: bool = _option(
        False, "evaluate the mean token loss on held-out data every validation.freq steps (and at the last step)"
    )
    dataset: Literal["", "stdlib", "text", "shards"] = _option(
        "",
        "validation data, as training.dataset; empty = hold out validation.split_fraction of the training data",
    )
    dataset_path: str = _option("", "as training.dataset_path, for validation.dataset")
    split_fraction: float = _option(
        0.05,
        "with validation.dataset empty: the fraction of the training samples (the last windows of each source) "
        "reserved for validation and never trained on",
        between(0, 1, low_open=True, high_open=True, message=HELD_OUT),
    )
    freq: int = _option(100, "evaluate every this many steps (and at the last step)", at_least(1))
    steps: int = _option(
        10, "validation batches per evaluation: the same batches, fixed by training.seed, each time", at_least(1)
    )
    local_batch_size: int = _option(
        -1,
        "sequences per data-parallel rank per validation batch; -1 = training.local_batch_size",
        at_least(1, "use -1 (training.local_batch_size) or a positive number.", also=(-1,)),
    )


@dataclass
class HFExport:
    """Hugging Face folders (save_pretrained's layout) written while training, each rank writing its own tensors."""

    enable: bool = _option(
        False,
        "write {job.dump_folder}/{hf_export.folder}/step-N/ (config.json, safetensors, tokenizer) every "
        "hf_export.interval steps and at the last step; transformers' from_pretrained loads it",
    )
    folder: str = _option("hf", "folder of the exports, under job.dump_folder unless absolute")
    interval: int = _option(500, "export every this many steps (and at the last step)", at_least(1))
    keep_latest_k: int = _option(0, "keep only the newest k complete exports; 0 keeps all", at_least(0))
    dtype: Literal["", "float32", "bfloat16"] = _option(
        "", "the exported weights' dtype; empty = the dtype the model holds them in"
    )
    async_mode: Literal["disabled", "async"] = _option(
        "async",
        "'async': training waits while each tensor is gathered to the rank that writes it and copied to the host, "
        "not while the files are written (a thread) and the folder is published; 'disabled': it waits for all",
    )


@dataclass
class Eval:
    """Downstream evaluation during training: multiple-choice tasks scored by log-likelihood, as
    lm-evaluation-harness scores them (the validation loss has its own section, [validation])."""

    tasks: list[str] = _option(
        [],
        'JSONL files, one multiple-choice question a line: {"context": str, "choices": [str, ...], "answer": '
        "int}; each file is a task named by its file name without .jsonl, logged as eval/<task>/acc and acc_norm",
    )
    freq: int = _option(100, "evaluate every this many steps (and at the last step)", at_least(1))
    local_batch_size: int = _option(
        8,
        "(context, choice) sequences per data-parallel rank per forward pass, padded to the longest of them",
        at_least(1),
    )
    max_length: int = _option(
        0,
        "the most tokens a (context, choice) row feeds the model: a longer row keeps its last max_length + 1 tokens "
        "(lm-evaluation-harness's max_length, which defaults to the model's context); 0 = training.seq_len",
        at_least(0),
    )


@dataclass
class JobConfig:
    """Every option of a training job: one field per TOML section."""

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    quantize: Quantize = field(default_factory=Quantize)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    comm: Comm = field(default_factory=Comm)
    metrics: Metrics = field(default_factory=Metrics)
    validation: Validation = field(default_factory=Validation)
    eval: Eval = field(default_factory=Eval)
    hf_export: HFExport = field(default_factory=HFExport)
    profiling: Profiling = field(default_factory=Profiling)
