"""Published training runs on the planner's keys: the corpus `bench/plan_vs_published.py --all` predicts (issue 61).

Each `Run` is one row of a public table: its source (title, where, table, row), its model on planner keys, its
layout, precision, published throughput (tokens/s per GPU, or what the table states and the conversion to it), and
its memory where the table gives one. The model's efficiencies are fitted on the calibration rows only
(`Source.calibration`: Megatron-LM 2021's Tables 1 and 2, MosaicML llm-foundry's H100 BF16 table, torchtitan's 8B
rows); every other row is evaluation only. What a source does not state and a row had to assume is in its
`assumed` text.

GPT-style models (Megatron's GPT, MosaicML's MPT: a 4 x width GELU MLP, LayerNorm, tied embeddings) run as Llama 3
blocks of the same width, depth and heads with the `debugmodel_tied` flavor's rules (tied embeddings) and their own
MLP, model.mlp's GELU of 4 x width (MPT's exact GELU, Megatron's tanh-approximated fused bias-GELU), set by the model.*
shape keys; what remains Llama's is RMSNorm for LayerNorm, RoPE for learned or ALiBi positions, and no biases.
The frameworks' fused kernels (Megatron's fused LayerNorm, bias-GeLU and softmax, MPT's low-precision LayerNorm and
flash attention, Megatron-Core's TransformerEngine layers) are torchpre's blocks under torch.compile: what an eager
torchpre block saves and moves beyond them, the compiled one does not (`FUSED`).
"""

import dataclasses
from dataclasses import dataclass, field

GiB = 2**30
FUSED = "the framework's fused kernels as torch.compile's fusion (compile.enable)"


@dataclass(frozen=True)
class Source:
    title: str
    where: str  # an arXiv id or a repository and path
    table: str
    calibration: bool  # the model's efficiencies are fitted on these rows; the others only evaluate it
    hardware: str  # the planner's row for the source's GPUs and network
    short: str  # the label the tables print
    # Why issue 61's throughput and fit targets leave this evaluation source's rows out ("" = they count): a run
    # whose implementation torchpre cannot express. Its rows are still predicted, printed and pinned.
    outside_target: str = ""


MEGATRON_1 = Source(
    "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM (Narayanan et al., SC21)",
    "arXiv 2104.04473", "Table 1 (weak scaling, 1.7B to 1T)", True, "a100-80gb", "megatron21 t1")
MEGATRON_2 = Source(
    MEGATRON_1.title, "arXiv 2104.04473", "Table 2 (PTD-P against ZeRO-3 without model parallelism)", True,
    "a100-80gb", "megatron21 t2")
MOSAIC_H100 = Source(
    "MPT Training Benchmarks", "mosaicml/llm-foundry scripts/train/benchmarking/README.md", "H100 80GB BF16", True,
    "h100-80gb", "mosaic h100 bf16")
TORCHTITAN = Source(
    "torchtitan Llama 3.1 benchmarks (2024-12)", "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md",
    "Tables 1-3 (8B)", True, "h100-96gb-hbm2e-500w", "torchtitan")
TORCHTITAN_HELD_OUT = Source(
    TORCHTITAN.title, TORCHTITAN.where, "Tables 4-6 (70B, 405B)", False, "h100-96gb-hbm2e-500w", "torchtitan")
MOSAIC_A100 = Source(
    "MPT Training Benchmarks", "mosaicml/llm-foundry scripts/train/benchmarking/README.md",
    "A100 80GB with 1600 Gbps node-node interconnect (RoCE)", False, "a100-80gb", "mosaic a100 bf16")
MOSAIC_H100_FP8 = Source(
    "MPT Training Benchmarks", "mosaicml/llm-foundry scripts/train/benchmarking/README.md", "H100 80GB FP8", False,
    "h100-80gb", "mosaic h100 fp8")
LLAMA3 = Source(
    "The Llama 3 Herd of Models", "arXiv 2407.21783", "Table 4 (Llama 3 405B pre-training)", False, "h100-80gb",
    "llama3 paper")
# Megatron-Core's FP8 runs are not layouts of torchpre: they run whole TransformerEngine layers (LayerNorm fused into
# the FP8 linears, cuDNN's fused attention, tensor-parallel communication overlapped with the GEMMs, FP8 copies of the
# linears' inputs saved for backward where torchao's float8 saves the bf16 input); torchpre has none of these.
# (MosaicML's FP8 rows run TransformerEngine's FP8 linears alone, inside llm-foundry's blocks: they count.)
MEGATRON_CORE_FP8 = ("Megatron-Core's TransformerEngine layers (fused LayerNorm and FP8 linears, cuDNN attention, "
                     "tensor-parallel overlap, FP8 activations saved for backward), which torchpre does not implement")
NEMO = Source(
    "NeMo Performance Benchmarks (NeMo 24.07, DGX-H100)", "NVIDIA/NeMo docs/source/performance/performance_summary.md",
    "Pretraining (FP8)", False, "h100-80gb", "nemo 24.07 fp8", MEGATRON_CORE_FP8)
BRIDGE = Source(
    "Megatron-Bridge performance summary (25.11 NeMo container, DGX-H100)",
    "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md", "Pre-Training Performance, DGX-H100", False,
    "h100-80gb", "megatron-bridge 25.11 fp8", MEGATRON_CORE_FP8)


@dataclass(frozen=True)
class Model:
    """A model on planner keys: a flavor and, for shapes no flavor has, the model.* shape keys (0 = the flavor's)."""

    label: str
    flavor: str
    dim: int = 0
    n_layers: int = 0
    n_heads: int = 0
    n_kv_heads: int = 0
    vocab_size: int = 0
    mlp: str = ""  # model.mlp; "" = the flavor's (SwiGLU)

    def keys(self) -> list[str]:
        keys = ["--model.flavor", self.flavor]
        for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "mlp"):
            if getattr(self, key):
                keys += [f"--model.{key}", str(getattr(self, key))]
        return keys


def gpt(label: str, dim: int, n_layers: int, n_heads: int, vocab_size: int, mlp: str = "gelu") -> Model:
    """A GPT-style model (a GELU MLP 4 x width wide, tied embeddings, multi-head attention) as Llama 3 blocks of its
    shape with model.mlp = `mlp`."""
    return Model(label, "debugmodel_tied", dim, n_layers, n_heads, n_heads, vocab_size, mlp)


@dataclass(frozen=True)
class Run:
    """One published run and its keys. `microbatch`: sequences per microbatch (per pipeline microbatch under
    pipelining, else per gradient-accumulation step); `global_batch`: sequences per step."""

    source: Source
    row: str  # the row as its table names it
    model: Model
    gpus: int
    seq_len: int
    global_batch: int
    microbatch: int
    tokens_per_s_per_gpu: float
    published: str  # what the table states for throughput (and the conversion, when it is not tokens/s per GPU)
    tp: int = 1
    pp: int = 1
    cp: int = 1
    schedule: str = ""  # with pp > 1
    virtual_stages: int = 1
    zero_stage: int = 3
    activation_checkpoint: str = "full"  # none | selective (per op) | full
    sequence_parallel: bool = True
    fp8: bool = False
    compile: bool = False
    reduce_dtype: str = "float32"
    memory_gib: float | None = None  # the peak the CUDA caching allocator reserved, where published
    assumed: str = ""  # what the source does not state and the row assumes
    extra: tuple[str, ...] = field(default=())
    # Pipeline knobs the source does not state ("schedule", "virtual_stages", "microbatch"): the row is predicted at
    # every legal value of them (`choices`) and the planner's choice kept (`bench.plan_vs_published.settle`), one
    # rule for every such row instead of a value picked per row.
    unstated: tuple[str, ...] = ()

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def name(self) -> str:
        """The row's layout; an unstated knob (`unstated`) as "?"."""
        degrees = "".join(f" {axis}{n}" for axis, n in (("tp", self.tp), ("pp", self.pp), ("cp", self.cp)) if n > 1)
        schedule = f" {self.schedule}" + (f" v{self.virtual_stages}" if self.virtual_stages > 1 else "")
        if "schedule" in self.unstated:
            schedule = " schedule?"
        elif "virtual_stages" in self.unstated:
            schedule = f" {self.schedule} v?"
        microbatch = "?" if "microbatch" in self.unstated else self.microbatch
        extras = "+compile" * self.compile + " fp8" * self.fp8
        return (f"{self.source.short}: {self.model.label} {self.gpus}gpu dp{self.dp}{degrees}"
                f"{schedule if self.pp > 1 else ''} z{self.zero_stage} seq{self.seq_len} mb{microbatch} "
                f"ac:{self.activation_checkpoint}{extras}")

    @property
    def pipeline_choice(self) -> str:
        """The values of its unstated knobs, as the name prints them ("" when it has none)."""
        if not self.unstated:
            return ""
        return f"{self.schedule}" + (f" v{self.virtual_stages}" if self.virtual_stages > 1 else "") + (
            f" mb{self.microbatch}")

    def argv(self) -> list[str]:
        """The job's keys, as `python -m torchpre.plan --fixed` takes them."""
        keys = [*self.model.keys(), "--training.dataset", "synthetic", "--training.mixed_precision_param",
                "bfloat16", "--optimizer.reduce_dtype", self.reduce_dtype, "--optimizer.zero_stage",
                str(self.zero_stage), "--training.seq_len", str(self.seq_len),
                "--training.global_batch_size", str(self.global_batch),
                "--parallelism.data_parallel_degree", str(self.dp),
                "--parallelism.context_parallel_degree", str(self.cp),
                "--activation_checkpoint.mode", self.activation_checkpoint]  # fmt: skip
        local = self.global_batch // self.dp
        if self.tp > 1:
            keys += ["--parallelism.tensor_parallel_degree", str(self.tp), "--parallelism.enable_loss_parallel"]
            keys += ["--parallelism.enable_sequence_parallel"] * self.sequence_parallel
        if self.pp > 1:
            keys += ["--parallelism.pipeline_parallel_degree", str(self.pp),
                     "--parallelism.pipeline_parallel_schedule", self.schedule,
                     "--parallelism.pipeline_parallel_virtual_stages", str(self.virtual_stages),
                     "--parallelism.pipeline_parallel_microbatch_size", str(self.microbatch),
                     "--training.local_batch_size", str(local)]  # fmt: skip
        else:
            keys += ["--training.local_batch_size", str(self.microbatch)]
        keys += ["--compile.enable"] * self.compile
        keys += ["--quantize.linear", "float8", "--quantize.recipe", "tensorwise"] * self.fp8
        return [*keys, *self.extra]

    def choices(self, n_units: int) -> list["Run"]:
        """The row with each legal value of its `unstated` knobs, the stated ones fixed: "schedule", 1F1B or
        Interleaved 1F1B at any stages per rank; "virtual_stages", Interleaved 1F1B's stages per rank from 2; up to
        as many as leave every stage one of the `n_units` (the blocks, and the embedding and the output where the
        split counts them as layers: start-up's rule); "microbatch", every size that divides a data-parallel rank's
        sequences."""
        stages = [self.virtual_stages]
        if {"schedule", "virtual_stages"} & set(self.unstated):
            stages = list(range(1 if "schedule" in self.unstated else 2, n_units // self.pp + 1))
        local = self.global_batch // self.dp
        sizes = [m for m in range(1, local + 1) if local % m == 0]
        if "microbatch" not in self.unstated:
            sizes = [self.microbatch]
        return [dataclasses.replace(self, virtual_stages=v, microbatch=m, schedule=self._schedule(v))
                for v in stages for m in sizes]  # fmt: skip

    def _schedule(self, virtual_stages: int) -> str:
        if virtual_stages == self.virtual_stages:
            return self.schedule
        return "Interleaved1F1B" if virtual_stages > 1 else "1F1B"


# --- Megatron-LM 2021 (A100 80GB, DGX A100 nodes on Selene: 8 x 200 Gb/s HDR InfiniBand) --------------------------
# Table 1 as the paper prints it (transcribed in SotaroKaneda/MLCarbon data/megatron_table.csv, which matches it),
# the microbatch sizes, interleaving and recomputation from the paper's own scripts (NVIDIA/Megatron-LM
# examples/sc21/run_table_1.sh: MBS, --num-layers-per-virtual-pipeline-stage, --recompute-method uniform). Throughput
# is published as teraFLOP/s per GPU counted with the paper's equation (3): F = 96 B s l h^2 (1 + s / 6h + V / 16lh)
# per iteration (recomputation included), so tokens/s per GPU = X / (96 l h^2 (1 + s / 6h + V / 16lh)).
MEGATRON_VOCAB, MEGATRON_SEQ = 51200, 2048
# Megatron-LM's GPT MLP under --bias-gelu-fusion (on by default): the tanh approximation (fused_bias_gelu.py).
MEGATRON_GELU = "gelu_tanh"


def megatron_tokens(tflops: float, dim: int, n_layers: int) -> float:
    """Tokens/s per GPU from the paper's teraFLOP/s per GPU (its equation 3)."""
    s, h, layers, v = MEGATRON_SEQ, dim, n_layers, MEGATRON_VOCAB
    return tflops * 1e12 / (96 * layers * h**2 * (1 + s / (6 * h) + v / (16 * layers * h)))


def _megatron_t1(params: str, heads: int, dim: int, n_layers: int, tp: int, pp: int, gpus: int, batch: int,
                 tflops: float, microbatch: int, virtual: int) -> Run:  # fmt: skip
    schedule = ("Interleaved1F1B" if virtual > 1 else "1F1B") if pp > 1 else ""
    return Run(MEGATRON_1, f"{params}B: {gpus} GPUs, tp{tp} pp{pp}, batch {batch}, {tflops:.0f} TFLOP/s",
               gpt(f"gpt-{params}B", dim, n_layers, heads, MEGATRON_VOCAB, MEGATRON_GELU), gpus, MEGATRON_SEQ, batch,
               microbatch,
               megatron_tokens(tflops, dim, n_layers), f"{tflops:.0f} teraFLOP/s per GPU (equation 3)", tp=tp, pp=pp,
               schedule=schedule, virtual_stages=virtual, zero_stage=0, sequence_parallel=False, compile=True,
               assumed="bf16 for the paper's mixed precision (the A100's fp16 and bf16 peaks are equal); no "
                       "sequence parallelism (2021); data-parallel gradients all-reduced in fp32; LayerNorm and "
                       f"learned positions as Llama 3's RMSNorm and RoPE; {FUSED}",
               )  # fmt: skip


MEGATRON_T1 = (
    _megatron_t1("1.7", 24, 2304, 24, 1, 1, 32, 512, 137, 16, 1),
    _megatron_t1("3.6", 32, 3072, 30, 2, 1, 64, 512, 138, 16, 1),
    _megatron_t1("7.5", 32, 4096, 36, 4, 1, 128, 512, 142, 16, 1),
    _megatron_t1("18.4", 48, 6144, 40, 8, 1, 256, 1024, 135, 8, 1),
    _megatron_t1("39.1", 64, 8192, 48, 8, 2, 512, 1536, 138, 4, 1),
    _megatron_t1("76.1", 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 3),
    _megatron_t1("145.6", 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 2),
    _megatron_t1("310.1", 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 2),
    _megatron_t1("529.6", 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 3),
    _megatron_t1("1008.0", 160, 25600, 128, 8, 64, 3072, 3072, 163, 1, 1),
)

# Table 2 (transcribed in two secondary notes that agree with each other and the paper's text: 175B on 1,536 GPUs
# at 141 (PTD-P) and 44 (ZeRO-3) teraFLOP/s): GPT-3 175B (h 12288, 96 layers, 96 heads) and 530B (h 20480, 105
# layers, 128 heads). ZeRO-3 "without model parallelism": DeepSpeed ZeRO-3 over every GPU, one microbatch per step.
# PTD-P: model-parallel size 96 = tp8 x pp12 and 280 = tp8 x pp35, microbatch 1.
GPT_175B = gpt("gpt-174.6B", 12288, 96, 96, MEGATRON_VOCAB, MEGATRON_GELU)
GPT_530B = gpt("gpt-529.6B", 20480, 105, 128, MEGATRON_VOCAB, MEGATRON_GELU)


def _megatron_t2(model: Model, gpus: int, batch: int, microbatch: int, tflops: float, tp: int = 1, pp: int = 1) -> Run:
    zero3 = tp == 1
    scheme = "ZeRO-3 without model parallelism" if zero3 else f"PTD-P (model-parallel size {tp * pp})"
    schedule = "1F1B" if pp > 1 else ""
    assumed = ("DeepSpeed ZeRO-3, which gathers each parameter as it is used (up to stage3_max_live_parameters), "
               "as FSDP2 units per sub-layer (parallelism.fsdp_wrap = sublayer), torchpre's nearer layout; full "
               "recomputation" if zero3 else
               "the schedule (not stated for Table 2): the planner's choice of 1F1B or Interleaved 1F1B at any "
               "stages per rank (`Run.unstated`)")
    return Run(MEGATRON_2, f"{scheme}, {model.label}, {gpus} GPUs, batch {batch}, microbatch {microbatch}, "
               f"{tflops:.0f} TFLOP/s", model, gpus, MEGATRON_SEQ, batch, microbatch,
               megatron_tokens(tflops, model.dim, model.n_layers), f"{tflops:.0f} teraFLOP/s per GPU (equation 3)",
               tp=tp, pp=pp, schedule=schedule, zero_stage=3 if zero3 else 0,
               sequence_parallel=False, compile=True, unstated=() if zero3 else ("schedule",),
               extra=("--parallelism.fsdp_wrap", "sublayer") if zero3 else (),
               assumed=assumed + f"; bf16 for the paper's mixed precision; no sequence parallelism; {FUSED}",
               )  # fmt: skip


MEGATRON_T2 = (
    _megatron_t2(GPT_175B, 384, 1536, 4, 144),
    _megatron_t2(GPT_175B, 768, 1536, 2, 88),
    _megatron_t2(GPT_175B, 1536, 1536, 1, 44),
    _megatron_t2(GPT_530B, 640, 2560, 4, 138),
    _megatron_t2(GPT_530B, 1120, 2240, 2, 98),
    _megatron_t2(GPT_530B, 2240, 2240, 1, 48),
    _megatron_t2(GPT_175B, 384, 1536, 1, 153, tp=8, pp=12),
    _megatron_t2(GPT_175B, 768, 1536, 1, 149, tp=8, pp=12),
    _megatron_t2(GPT_175B, 1536, 1536, 1, 141, tp=8, pp=12),
    _megatron_t2(GPT_530B, 560, 2240, 1, 171, tp=8, pp=35),
    _megatron_t2(GPT_530B, 1120, 2240, 1, 167, tp=8, pp=35),
    _megatron_t2(GPT_530B, 2240, 2240, 1, 159, tp=8, pp=35),
)

# --- MosaicML llm-foundry MPT benchmarks ---------------------------------------------------------------------------
# MPT shapes from llm-foundry's scripts/train/yamls/pretrain/mpt-*.yaml (d_model, n_layers, n_heads; vocabulary
# 50,368; expansion ratio 4). Composer's FSDP FULL_SHARD is ZeRO-3 resharded after forward; mixed precision
# "DEFAULT" keeps bf16 parameters and reduces in fp32, "PURE" reduces in bf16; "Activation Checkpointing True" wraps
# every block (full). Every GPU reads its microbatch; GradAccum microbatches make the global batch. MPT's loss is
# flash-attn's fused cross-entropy (llm-foundry's default loss_fn, computed in place: no fp32 copy of the logits), as
# torchpre's chunked loss (training.loss_chunk_size).
MPT_LOSS_CHUNK = ("--training.loss_chunk_size", "2048")
MPT_VOCAB = 50368
MPT = {
    "125m": gpt("mpt-125m", 768, 12, 12, MPT_VOCAB),
    "350m": gpt("mpt-350m", 1024, 24, 16, MPT_VOCAB),
    "760m": gpt("mpt-760m", 1536, 24, 12, MPT_VOCAB),
    "1b": gpt("mpt-1b", 2048, 24, 16, MPT_VOCAB),
    "3b": gpt("mpt-3b", 2560, 32, 20, MPT_VOCAB),
    "7b": gpt("mpt-7b", 4096, 32, 32, MPT_VOCAB),
    "13b": gpt("mpt-13b", 5120, 40, 40, MPT_VOCAB),
    "30b": gpt("mpt-30b", 7168, 48, 56, MPT_VOCAB),
    "70b": gpt("mpt-70b", 8192, 80, 64, MPT_VOCAB),
}


def _mosaic(source: Source, table: str, fp8: bool = False) -> tuple[Run, ...]:
    """Rows of one of the README's tables: model, seq, GPUs, microbatch, grad accum, global batch, T/s/GPU,
    mixed precision mode, activation checkpointing (the table's own columns, in its order)."""
    runs = []
    for line in table.strip().splitlines():
        size, seq, gpus, microbatch, accumulation, batch, tokens, mode, ac = line.split()
        gpus, microbatch, batch = int(gpus), int(microbatch), int(batch)
        if microbatch * int(accumulation) * gpus != batch:
            continue  # the engine's uneven last microbatch: not a layout the planner's keys express
        runs.append(Run(source, f"{size} seq {seq} on {gpus} GPUs, microbatch {microbatch} x {accumulation}, "
                                f"{tokens} T/s/GPU", MPT[size], gpus, int(seq), batch, microbatch, float(tokens),
                        f"{tokens} Throughput (T/s/GPU)", zero_stage=3,
                        activation_checkpoint="full" if ac == "True" else "none", fp8=fp8, compile=True,
                        reduce_dtype="bfloat16" if mode == "PURE" else "float32",
                        extra=MPT_LOSS_CHUNK,
                        assumed="MPT's LayerNorm and ALiBi as Llama 3's RMSNorm and RoPE, its exact-GELU MLP as "
                                f"model.mlp = 'gelu'; {FUSED}; its "
                                "fused cross-entropy as the chunked loss"
                                + ("; TransformerEngine's FP8 linears as torchao's tensorwise float8" if fp8 else "")))
    return tuple(runs)


MOSAIC_H100_ROWS = _mosaic(MOSAIC_H100, """
70b 2048 64 8 4 2048 1039 DEFAULT True
70b 2048 32 2 16 1024 882 DEFAULT True
30b 8192 8 1 21 168 1384 DEFAULT True
30b 4096 8 1 21 168 1802 DEFAULT True
30b 2048 32 14 3 1344 2308 DEFAULT True
30b 2048 16 10 3 480 2263 DEFAULT True
30b 2048 8 3 21 504 2002 DEFAULT True
30b 1024 8 6 21 1008 2084 DEFAULT True
13b 32768 8 1 3 24 1976 DEFAULT True
13b 16384 8 3 3 72 2985 DEFAULT True
13b 4096 8 10 3 240 4717 DEFAULT True
13b 2048 64 2 1 128 4800 DEFAULT False
13b 2048 32 2 1 64 4811 DEFAULT False
13b 2048 16 2 1 32 4767 DEFAULT False
13b 2048 8 2 1 16 4792 DEFAULT False
13b 1024 8 40 3 960 5502 DEFAULT True
7b 65536 8 1 2 16 1956 DEFAULT True
7b 32768 8 2 2 32 3318 DEFAULT True
7b 8192 8 8 2 128 6935 DEFAULT True
7b 4096 8 16 2 256 8611 DEFAULT True
7b 2048 8 6 1 48 10643 DEFAULT False
7b 1024 8 64 2 1024 10203 DEFAULT True
3b 65536 8 1 2 16 3262 DEFAULT True
3b 32768 8 3 6 144 5873 DEFAULT True
3b 16384 8 1 6 48 11152 DEFAULT False
3b 8192 8 3 6 144 16578 DEFAULT False
3b 4096 8 5 6 240 20964 DEFAULT False
3b 2048 64 6 3 1152 22525 DEFAULT False
3b 2048 32 6 3 576 23021 DEFAULT False
3b 2048 16 10 3 480 24142 DEFAULT False
3b 1024 8 20 6 960 27046 DEFAULT False
3b 512 8 40 6 1920 27965 DEFAULT False
1b 65536 8 1 2 16 5506 DEFAULT True
1b 32768 8 1 4 32 12025 DEFAULT False
1b 16384 8 2 4 64 19649 DEFAULT False
1b 8192 8 3 4 96 29157 DEFAULT False
1b 4096 8 7 4 224 38535 DEFAULT False
1b 2048 64 20 1 1280 44402 DEFAULT False
1b 2048 32 20 1 640 45130 DEFAULT False
1b 2048 16 20 1 320 46037 DEFAULT False
1b 2048 8 14 1 112 45455 DEFAULT False
1b 1024 8 18 4 576 48910 DEFAULT False
1b 512 8 56 4 1792 52275 DEFAULT False
760m 32768 8 1 2 16 16291 DEFAULT False
760m 16384 8 3 2 48 27815 DEFAULT False
760m 8192 8 6 2 96 41825 DEFAULT False
760m 4096 8 12 2 192 55459 DEFAULT False
760m 2048 32 24 1 768 67971 DEFAULT False
760m 2048 16 24 1 384 68551 DEFAULT False
760m 2048 8 24 2 384 63147 DEFAULT False
760m 1024 8 48 2 768 78581 DEFAULT False
760m 512 8 96 2 1536 83749 DEFAULT False
""")

MOSAIC_H100_FP8_ROWS = _mosaic(MOSAIC_H100_FP8, """
3b 32768 8 3 6 144 5856 DEFAULT True
3b 8192 8 3 6 144 19146 DEFAULT False
3b 2048 8 10 6 480 30586 DEFAULT False
3b 512 8 40 6 1920 36527 DEFAULT False
1b 32768 8 1 4 32 12580 DEFAULT False
1b 8192 8 2 4 64 32010 DEFAULT False
1b 512 8 56 4 1792 70315 DEFAULT False
350m 32768 8 1 4 32 24439 DEFAULT False
350m 16384 8 2 4 64 42929 DEFAULT False
350m 512 8 56 4 1792 154420 DEFAULT False
""", fp8=True)

MOSAIC_A100_ROWS = _mosaic(MOSAIC_A100, """
70b 2048 64 8 4 2048 410 PURE True
70b 2048 32 2 16 1024 373 PURE True
30b 8192 8 1 21 168 574 DEFAULT True
30b 4096 8 1 21 168 814 DEFAULT True
30b 2048 8 3 21 504 916 DEFAULT True
30b 1024 8 6 21 1008 946 DEFAULT True
30b 512 8 12 21 2016 967 DEFAULT True
13b 32768 8 1 3 24 1016 DEFAULT True
13b 16384 8 3 3 72 1431 DEFAULT True
13b 8192 8 5 3 120 1795 DEFAULT True
13b 4096 8 10 3 240 2060 DEFAULT True
13b 2048 8 2 3 48 2262 DEFAULT False
13b 1024 8 40 3 960 2330 DEFAULT True
7b 65536 8 1 2 16 1013 DEFAULT True
7b 32768 8 2 2 32 1672 DEFAULT True
7b 16384 8 4 2 64 2453 DEFAULT True
7b 8192 8 8 2 128 3206 DEFAULT True
7b 4096 8 16 2 256 3684 DEFAULT True
7b 2048 8 6 2 96 4641 DEFAULT False
7b 1024 8 64 2 1024 4357 DEFAULT True
3b 65536 8 1 2 16 1767 DEFAULT True
3b 32768 8 3 6 144 3029 DEFAULT True
3b 16384 8 1 6 48 5529 DEFAULT False
3b 8192 8 3 6 144 7695 DEFAULT False
3b 4096 8 5 6 240 9457 DEFAULT False
3b 2048 8 10 2 160 10811 DEFAULT False
3b 1024 8 20 6 960 11580 DEFAULT False
3b 512 8 40 6 1920 12127 DEFAULT False
1b 65536 8 1 2 16 3044 DEFAULT True
1b 32768 8 1 4 32 6275 DEFAULT False
1b 16384 8 2 4 64 9956 DEFAULT False
1b 8192 8 3 4 96 13814 DEFAULT False
1b 4096 8 7 4 224 17807 DEFAULT False
1b 2048 8 14 4 448 20513 DEFAULT False
1b 1024 8 18 4 576 22112 DEFAULT False
1b 512 8 56 4 1792 23148 DEFAULT False
760m 65536 8 1 2 16 4143 DEFAULT True
760m 32768 8 1 2 16 8802 DEFAULT False
760m 16384 8 3 2 48 14274 DEFAULT False
760m 8192 8 6 2 96 20933 DEFAULT False
760m 4096 8 12 2 192 27351 DEFAULT False
760m 2048 8 24 2 384 32434 DEFAULT False
760m 1024 8 48 2 768 29765 DEFAULT False
760m 512 8 96 2 1536 29446 DEFAULT False
350m 65536 8 1 2 16 7524 DEFAULT False
350m 32768 8 2 2 32 13652 DEFAULT False
350m 16384 8 4 2 64 23559 DEFAULT False
350m 8192 8 8 2 128 36569 DEFAULT False
350m 4096 8 16 2 256 49555 DEFAULT False
350m 2048 8 32 2 512 58782 DEFAULT False
350m 1024 8 64 2 1024 64813 DEFAULT False
350m 512 8 128 2 2048 69330 DEFAULT False
125m 65536 8 1 2 16 20368 DEFAULT False
125m 32768 8 2 2 32 36407 DEFAULT False
125m 16384 8 4 2 64 60040 DEFAULT False
125m 8192 8 8 2 128 90392 DEFAULT False
125m 4096 8 16 2 256 118396 DEFAULT False
125m 2048 8 40 2 640 142830 DEFAULT False
125m 2048 8 32 2 512 141737 DEFAULT False
125m 1024 8 64 2 1024 156468 DEFAULT False
125m 512 8 128 2 2048 165681 DEFAULT False
""")

# --- torchtitan (Meta's Grand Teton H100 96GB HBM2e at 500 W) ------------------------------------------------------
# The runs' keys as torchtitan's llama3_*.toml of 9dec370 set them (bench/plan_vs_published.py's docstring).
LLAMA_VOCAB = 128256
TORCHTITAN_ASSUMED = "torchtitan's Float8 is torchao's tensorwise float8; a pipeline of one microbatch per stage"


def _titan(source: Source, table: int, flavor: str, gpus: int, seq: int, local: int, tps: float, memory: float,
           ac: str = "selective", compile: bool = False, fp8: bool = False, tp: int = 1, pp: int = 1, cp: int = 1,
           schedule: str = "") -> Run:  # fmt: skip
    virtual = 2 if schedule == "Interleaved1F1B" else 1
    dp = gpus // (tp * pp * cp)
    microbatch = local // (pp * virtual) if pp > 1 else local
    techniques = "+".join(filter(None, ("FSDP", "compile" * compile, "Float8" * fp8)))
    return Run(source, f"Table {table}: {flavor} on {gpus} GPUs ({techniques}{', ' + schedule if schedule else ''}, "
               f"seq {seq}), {tps:,.0f} TPS/GPU, {memory} GiB",
               Model(f"llama3.1-{flavor}", flavor, vocab_size=LLAMA_VOCAB), gpus, seq, local * dp, microbatch, tps,
               f"{tps:,.0f} TPS/GPU", tp=tp, pp=pp, cp=cp, schedule=schedule, virtual_stages=virtual,
               activation_checkpoint=ac, compile=compile, fp8=fp8, memory_gib=memory,
               assumed=TORCHTITAN_ASSUMED)  # fmt: skip


TORCHTITAN_ROWS = (
    _titan(TORCHTITAN, 1, "8B", 8, 8192, 2, 5762, 82.4),
    _titan(TORCHTITAN, 1, "8B", 8, 8192, 2, 6667, 77.0, compile=True),
    _titan(TORCHTITAN, 1, "8B", 8, 8192, 2, 8532, 76.8, compile=True, fp8=True),
    _titan(TORCHTITAN, 2, "8B", 8, 32768, 1, 3890, 83.9, "full", True, True),
    _titan(TORCHTITAN, 2, "8B", 8, 65536, 1, 2540, 84.2, "full", True, True, cp=2),
    _titan(TORCHTITAN, 2, "8B", 8, 131072, 1, 1071, 84.0, "full", True, True, cp=4),
    _titan(TORCHTITAN, 2, "8B", 8, 262144, 1, 548, 84.5, "full", True, True, cp=8),
    _titan(TORCHTITAN, 3, "8B", 128, 8192, 2, 5605, 67.0),
    _titan(TORCHTITAN, 3, "8B", 128, 8192, 2, 6514, 62.0, compile=True),
    _titan(TORCHTITAN, 3, "8B", 128, 8192, 2, 8380, 61.8, compile=True, fp8=True),
)
# Table 4's "2D + AsyncTP" row and tables 5 and 6 run AsyncTP, which the model does not have (it charges the TP
# communication AsyncTP hides).
TORCHTITAN_HELD_OUT_ROWS = (
    _titan(TORCHTITAN_HELD_OUT, 4, "70B", 256, 8192, 16, 829, 71.9, "full", True, True, tp=8),
    _titan(TORCHTITAN_HELD_OUT, 5, "405B", 512, 8192, 32, 100, 82.5, "full", True, True, tp=8, pp=8,
           schedule="1F1B"),
    _titan(TORCHTITAN_HELD_OUT, 5, "405B", 512, 8192, 32, 128, 72.7, "full", True, True, tp=8, pp=8,
           schedule="Interleaved1F1B"),
    _titan(TORCHTITAN_HELD_OUT, 6, "405B", 512, 32768, 8, 76, 75.3, "full", True, True, tp=8, pp=8, schedule="1F1B"),
    _titan(TORCHTITAN_HELD_OUT, 6, "405B", 512, 65536, 8, 47, 75.9, "full", True, True, tp=8, pp=8, cp=2,
           schedule="1F1B"),
    _titan(TORCHTITAN_HELD_OUT, 6, "405B", 512, 131072, 8, 31, 77.1, "full", True, True, tp=8, pp=8, cp=4,
           schedule="1F1B"),
    _titan(TORCHTITAN_HELD_OUT, 6, "405B", 512, 262144, 8, 16, 84.9, "full", True, True, tp=8, pp=8, cp=8,
           schedule="1F1B"),
)

# --- The Llama 3 paper (Meta's Grand Teton H100 80GB HBM3 at 700 W, RoCE 400 Gb/s per GPU) --------------------------
# Table 4's TFLOPs/GPU as tokens/s per GPU by the model FLOPs torchpre counts (6 x the non-embedding parameters + the
# attention scores, PaLM's convention, which the paper's MFU cites): 2.625e12 per token for 405B at 8,192 tokens.
# Its third row (16,384 GPUs at 131,072 tokens) prints DP 4 where the GPU count and its 16M tokens per batch need 8:
# left out. Section 3.3.2: FSDP without resharding after forward, fp32 gradient reduce-scatter, an interleaved
# schedule, no activation checkpointing at 8K tokens.
LLAMA3_405B_FLOPS_PER_TOKEN = 6 * (405_853_388_800 - LLAMA_VOCAB * 16384) + 12 * 126 * 16384 * 8192
LLAMA3_ASSUMED = ("the stages per rank and the microbatch size, which the paper does not state, are the planner's "
                  "choice (`Run.unstated`); layers split evenly, where Meta's first and last stages hold one layer "
                  "less (its first chunk the embedding alone: 128 one-layer chunks, which torch's stages, each "
                  "holding a block, cannot express for 126 layers on 16 ranks); tensor parallelism with Megatron-LM's "
                  "sequence parallelism, which saves each attention's and feed-forward's sequence shard and gathers it "
                  "again in backward (parallelism.sequence_parallel_save_shard): the paper does not say, but its "
                  "tensor parallelism is Megatron-LM's, and its blocks kept far less than torchpre's saving the "
                  "gathered inputs (docs/planning.md)")


def _llama3(gpus: int, dp: int, per_dp: int, tflops: float) -> Run:
    return Run(LLAMA3, f"{gpus:,} GPUs, TP 8, CP 1, PP 16, DP {dp}, seq 8,192, batch/DP {per_dp}, {tflops:.0f} "
               f"TFLOPs/GPU", Model("llama3-405B", "405B", vocab_size=LLAMA_VOCAB), gpus, 8192, dp * per_dp, 1,
               tflops * 1e12 / LLAMA3_405B_FLOPS_PER_TOKEN, f"{tflops:.0f} TFLOPs/GPU (model FLOPs per token)", tp=8,
               pp=16, schedule="Interleaved1F1B", virtual_stages=2, activation_checkpoint="none",
               unstated=("virtual_stages", "microbatch"), assumed=LLAMA3_ASSUMED,
               extra=("--parallelism.sequence_parallel_save_shard", "--activation_checkpoint.recompute_mlp_activation",
                      "--parallelism.pipeline_parallel_embedding_layers", "1",
                      "--parallelism.pipeline_parallel_output_layers", "1"))  # fmt: skip


LLAMA3_ROWS = (_llama3(8192, 64, 32, 430), _llama3(16384, 128, 16, 400))

# --- NVIDIA NeMo 24.07 and Megatron-Bridge 25.11 on DGX-H100, FP8 (Megatron-Core with TransformerEngine) -------------
# Llama 2 shapes: 7B and 13B as Llama 3 blocks with the debug flavor's SwiGLU rule (11,008 and 13,824 wide, as
# Llama 2's), 70B as the 70B flavor (28,672 wide, GQA 8), all with Llama 2's 32,000-id vocabulary.
MEGATRON_CORE_ASSUMED = ("Megatron-Core's distributed optimizer as ZeRO-1, no activation recomputation, sequence "
                         "parallelism with tp, TransformerEngine's FP8 (current scaling) as torchao's tensorwise "
                         f"float8; {FUSED}")
LLAMA2_VOCAB = 32000
LLAMA2_7B = Model("llama2-7B", "debugmodel", 4096, 32, 32, 32, LLAMA2_VOCAB)
LLAMA2_13B = Model("llama2-13B", "debugmodel", 5120, 40, 40, 40, LLAMA2_VOCAB)
LLAMA2_70B = Model("llama2-70B", "70B", vocab_size=LLAMA2_VOCAB)
LLAMA3_8B = Model("llama3-8B", "8B", vocab_size=LLAMA_VOCAB)
LLAMA3_70B = Model("llama3-70B", "70B", vocab_size=LLAMA_VOCAB)
LLAMA31_405B = Model("llama3.1-405B", "405B", vocab_size=LLAMA_VOCAB)


def _megatron_core(source: Source, model: Model, gpus: int, batch: int, microbatch: int, seq: int, tokens: float,
                   tp: int = 1, pp: int = 1, cp: int = 1, virtual: int = 1, fsdp: bool = False) -> Run:  # fmt: skip
    schedule = ("Interleaved1F1B" if virtual > 1 else "1F1B") if pp > 1 else ""
    return Run(source, f"{model.label}: {gpus} GPUs, GBS {batch}, MBS {microbatch}, seq {seq}, TP {tp} PP {pp} CP {cp}"
               f" VP {virtual}{', FSDP' if fsdp else ''}, {tokens:,.0f} tokens/s/GPU", model, gpus, seq, batch,
               microbatch, tokens, f"{tokens:,.0f} Tokens / sec / GPU", tp=tp, pp=pp, cp=cp, schedule=schedule,
               virtual_stages=virtual, zero_stage=3 if fsdp else 1, activation_checkpoint="none", fp8=True,
               compile=True, assumed=MEGATRON_CORE_ASSUMED)  # fmt: skip


NEMO_ROWS = (
    _megatron_core(NEMO, LLAMA2_7B, 8, 128, 1, 4096, 16847),
    _megatron_core(NEMO, LLAMA2_13B, 16, 128, 1, 4096, 8646, pp=4, virtual=10),
    _megatron_core(NEMO, LLAMA2_70B, 64, 128, 1, 4096, 1707, tp=4, pp=4, virtual=20),
    _megatron_core(NEMO, LLAMA3_8B, 8, 128, 1, 8192, 12036, cp=2),
    _megatron_core(NEMO, LLAMA3_70B, 64, 128, 1, 8192, 1533, tp=4, pp=4, cp=2, virtual=5),
)
BRIDGE_ROWS = (
    _megatron_core(BRIDGE, LLAMA3_8B, 8, 128, 1, 8192, 14451, fsdp=True),
    _megatron_core(BRIDGE, LLAMA3_70B, 64, 128, 1, 8192, 1602, tp=4, pp=8, virtual=5),
    _megatron_core(BRIDGE, LLAMA31_405B, 1024, 512, 1, 8192, 292, tp=8, pp=8, cp=2, virtual=8),
)

CALIBRATION = (*MEGATRON_T1, *MEGATRON_T2, *MOSAIC_H100_ROWS, *TORCHTITAN_ROWS)
EVALUATION = (*TORCHTITAN_HELD_OUT_ROWS, *MOSAIC_A100_ROWS, *MOSAIC_H100_FP8_ROWS, *LLAMA3_ROWS, *NEMO_ROWS,
              *BRIDGE_ROWS)
CORPUS = (*CALIBRATION, *EVALUATION)
# The rows issue 61's targets are judged on: every evaluation row whose source torchpre can express.
TARGET = tuple(row for row in EVALUATION if not row.source.outside_target)
