"""The dry run builds the real training job for one rank of a large fake world and reports exactly what it holds.

The oracle is the layout's arithmetic, not the optimizer's own accounting: each parameter's local size from its
global shape and the tensor-parallel plan (column-parallel weights and the embedding split dim 0, row-parallel
weights dim 1, norms replicated), its ZeRO-1 shard the largest `torch.chunk` piece over DP of the first
dimension TP does not split, and AdamW's state 2 fp32 moments per shard element plus an fp32 step scalar per
parameter, with a bf16 parameter's fp32 master.
"""

import dataclasses
import math
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from torchpre.config.job_config import JobConfig
from torchpre.config.parser import parse_args
from torchpre.errors import ConfigError
from torchpre.models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS
from torchpre.models.deepseek_v3.model import DeepSeekV3Transformer
from torchpre.models.hf import HFCausalLM, hf_args
from torchpre.planner.dryrun import (
    DoesNotFit,
    RankMemory,
    build_rank,
    check_fits,
    dry_run_ranks,
    dry_run_world_size,
    probe_rank,
    rank_memory,
    run_dry_run,
)
from torchpre.planner.hardware import get_hardware
from torchpre.runtime.world import Runtime
from torchpre.training.job import TrainingJob, build_job
from torchpre.training.trainer import Trainer

COLUMN_PARALLEL = ("wq", "wk", "wv", "w1", "w3", "output", "tok_embeddings")
ROW_PARALLEL = ("wo", "w2")
STEP_BYTES = 4  # AdamW's step count: one fp32 scalar tensor per parameter


def _config(*argv: str) -> JobConfig:
    return parse_args(JobConfig, ["--training.dataset", "stdlib", *argv])


def _large(flavor: str, dp: int, tp: int, pp: int) -> JobConfig:
    microbatches = 2 * pp
    return _config(
        "--model.flavor", flavor,
        "--parallelism.data_parallel_degree", str(dp),
        "--parallelism.tensor_parallel_degree", str(tp),
        "--parallelism.pipeline_parallel_degree", str(pp),
        "--training.local_batch_size", "1",
        "--training.global_batch_size", str(microbatches * dp),
        "--training.seq_len", "2048",
        "--training.mixed_precision_param", "bfloat16",
        "--optimizer.zero_stage", "1",
        "--activation_checkpoint.mode", "full",
    )  # fmt: skip


def _tp_dim(name: str) -> int | None:
    leaf = name.split(".")[-2]
    return 0 if leaf in COLUMN_PARALLEL else 1 if leaf in ROW_PARALLEL else None


def _analytic(
    shapes: dict[str, torch.Size], tp: int, dp: int, tp_dim: Callable[[str], int | None] = _tp_dim
) -> tuple[int, int, int]:
    """(bf16 parameter bytes, fp32 gradient bytes, ZeRO-1 AdamW state bytes) of DP rank 0 from global shapes."""
    params = state = 0
    for name, shape in shapes.items():
        local = list(shape)
        split = tp_dim(name)
        if split is not None:
            assert local[split] % tp == 0, name
            local[split] //= tp
        numel = math.prod(local)
        params += numel
        zero_dim = next(d for d in range(len(local)) if d != split)
        shard = numel // local[zero_dim] * math.ceil(local[zero_dim] / dp)
        state += shard * (4 + 4 + 4) + STEP_BYTES  # fp32 master, exp_avg, exp_avg_sq
    return 2 * params, 4 * params, state


def _global_shapes(job: TrainingJob) -> dict[str, torch.Size]:
    """This rank's parameters under their plain-model names, with their global (unsharded) shapes."""
    shapes = {}
    for part in job.model.parts:
        for name, param in part.named_parameters():
            shapes[name.replace("._checkpoint_wrapped_module", "")] = param.shape
    return shapes


@pytest.mark.parametrize(
    "flavor, dp, tp, pp",
    [pytest.param("8B", 4, 8, 2, id="8B-at-64-ranks"), pytest.param("70B", 8, 8, 4, id="70B-at-256-ranks")],
)
def test_dry_run_reports_the_layouts_analytic_bytes(flavor, dp, tp, pp):
    config = _large(flavor, dp, tp, pp)
    world = dry_run_world_size(config)
    assert world == dp * tp * pp
    ranks = dry_run_ranks(config, world)
    assert ranks == [stage * dp * tp for stage in range(pp)]
    model_params = 0
    for stage, rank in enumerate(ranks):
        job = build_job(config, Runtime(world, fake_rank=rank))
        try:
            shapes = _global_shapes(job)
            memory = rank_memory(job)
        finally:
            dist.destroy_process_group()
        assert (memory.rank, memory.pp, memory.dp, memory.tp) == (rank, stage, 0, 0)
        params, grads, state = _analytic(shapes, tp, dp)
        assert memory.param_bytes == params
        assert memory.grad_bytes == grads
        assert memory.optimizer_state_bytes == state
        # The checkpoint holds this rank's parameters (as their fp32 masters' shards) and optimizer state.
        assert memory.checkpoint_bytes >= memory.optimizer_state_bytes
        model_params += sum(math.prod(s) for s in shapes.values())
    assert model_params == job.num_params  # the stages together hold the whole model, each block once


def test_a_fake_rank_holds_what_a_real_process_holds(monkeypatch):
    """The same tiny bf16 job built for real (gloo, CPU, world of one) and as a dry run's fake rank: equal bytes.
    A master counted by comparing storage pointers (0 for every meta tensor) would miss the fp32 masters."""
    config = _config("--model.flavor", "tiny", "--training.seq_len", "32")
    config.training.mixed_precision_param = "bfloat16"
    real = Trainer(config)
    try:
        expected = rank_memory(real.job)
    finally:
        dist.destroy_process_group()
    initialised = []
    spec = real.job.preflight.model_spec
    monkeypatch.setattr(type(spec.build), "init_weights", lambda *args: initialised.append(args), raising=True)
    fake = build_rank(config, 1, 0)
    assert not initialised  # a fake rank never draws full parameters
    assert dataclasses.replace(fake, activation_bytes=0, optimizer_step_bytes=0) == expected
    assert fake.activation_bytes > 0 and fake.optimizer_step_bytes > 0
    assert expected.optimizer_state_bytes > 2 * expected.param_bytes * 2  # masters (4 B) + moments (8 B) per bf16 (2 B)


def test_the_last_rank_of_a_1024_rank_world_is_the_last_of_every_dimension():
    config = _large("8B", 8, 8, 16)
    assert dry_run_world_size(config) == 1024
    assert dry_run_ranks(config, 1024) == [stage * 64 for stage in range(16)]
    job = build_job(config, Runtime(1024, fake_rank=1023))
    try:
        assert tuple(job.mesh.get_coordinate()) == (15, 7, 7)
        assert dist.get_world_size() == 1024
    finally:
        dist.destroy_process_group()


def test_world_size_and_ranks_are_checked():
    with pytest.raises(ConfigError, match="job.dry_run_world_size = N"):
        dry_run_world_size(_config())  # dp is -1: the world is unknown
    assert dry_run_world_size(_config("--job.dry_run_world_size", "6")) == 6
    with pytest.raises(ConfigError, match=r"job.dry_run_rank = 8: the dry run's world has ranks 0..7"):
        dry_run_ranks(_config("--job.dry_run_rank", "1,8"), 8)


def test_a_rank_that_does_not_fit_is_named_with_its_largest_part():
    hardware = get_hardware("a100-80gb")
    gib = 2**30
    fits = RankMemory(0, 0, 0, 0, 10 * gib, 10 * gib, 20 * gib, 5 * gib, 0)
    check_fits([fits], hardware)
    big = RankMemory(8, 1, 0, 0, 10 * gib, 10 * gib, 60 * gib, 5 * gib, 0)
    # 85 GiB of tensors, 100.30 with the allocator's 18%: over the 78.15 GiB an A100 80GB leaves the allocator
    expected = (r"rank 8 \(pp 1, dp 0, tp 0\) needs 100.30 GiB of the CUDA allocator \(85.00 GiB of tensors.* "
                r"largest part is its optimizer state")
    with pytest.raises(DoesNotFit, match=expected):
        check_fits([fits, big], hardware)
    # 70 GiB of tensors fit the 78.15 GiB; the 82.60 GiB the allocator reserves for them do not
    tensors_fit = RankMemory(8, 1, 0, 0, 10 * gib, 10 * gib, 45 * gib, 5 * gib, 0)
    with pytest.raises(DoesNotFit, match=r"needs 82.60 GiB of the CUDA allocator \(70.00 GiB of tensors"):
        check_fits([tensors_fit], hardware)


def test_a_compiled_job_dry_runs_eager_and_states_the_allocators_peak(capsys):
    """compile.enable: the blocks run eager under the probe (dynamo cannot trace under its dispatch modes), so the
    dry run counts what the eager job holds; the table adds the allocator's reserved estimate (x 1.18)."""
    argv = ("--parallelism.data_parallel_degree", "2", "--optimizer.zero_stage", "3", "--job.dry_run_world_size", "2")
    eager, compiled = (run_dry_run(_config(*argv, *extra)) for extra in ((), ("--compile.enable", "true")))
    assert [r.total_bytes for r in compiled] == [r.total_bytes for r in eager]
    reserved = eager[0].total_bytes * 1.18 / 2**30
    assert f"about {reserved:.2f} GiB on rank 0 (total x 1.18" in capsys.readouterr().out


def test_a_mixture_of_experts_counts_the_activations_of_a_balanced_router(capsys):
    """The router's splits depend on values, which meta tensors do not have: the dry run counts them as a balanced
    router's (and says so). Under ep2 each rank then receives what it sends, so its activations are one process's
    at the same local batch, up to the all-to-all's buffers."""
    common = ["--model.name", "moe", "--model.flavor", "debugmodel", "--training.seq_len", "64",
              "--training.local_batch_size", "2", "--job.dry_run_gpu", "h100-80gb"]  # fmt: skip
    (ep2,) = run_dry_run(_config(*common, "--parallelism.expert_parallel_degree", "2", "--job.dry_run_world_size",
                                 "2", "--job.dry_run_rank", "0"))  # fmt: skip
    assert "counted for a balanced router" in capsys.readouterr().out
    (one,) = run_dry_run(_config(*common, "--job.dry_run_world_size", "1"))
    assert ep2.param_bytes < one.param_bytes and ep2.optimizer_step_bytes > 0
    assert 0.9 < ep2.activation_bytes / one.activation_bytes < 1.2


def _mla_tp_dim(name: str) -> int | None:
    """deepseek_v3's plan: heads and experts' hidden units sharded, the latents' down-projections (`wq_a`, `wkv_a`),
    the norms and the router replicated; stacked experts are [experts, dim, hidden] (`w1`, `w3`) and
    [experts, hidden, dim] (`w2`)."""
    *_, module, leaf = name.split(".")
    if module == "experts":
        return 1 if leaf == "w2" else 2
    if module in ("wq_a", "wkv_a", "router"):
        return None
    return 0 if module in ("wq_b", "wkv_b", *COLUMN_PARALLEL) else 1 if module in ROW_PARALLEL else None


def test_deepseek_v3_dry_run_reports_the_mla_plans_analytic_bytes(capsys):
    """The debug model at dp2 x tp2, ZeRO-1, bf16: rank 0 holds what the plan says (measured: 462,080 parameter
    bytes of the whole model's 893,184: its 15,488 replicated parameters whole, the rest halved)."""
    config = _config("--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--training.seq_len", "32",
                     "--parallelism.data_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2",
                     "--optimizer.zero_stage", "1", "--training.local_batch_size", "1",
                     "--training.mixed_precision_param", "bfloat16", "--job.dry_run_world_size", "4")  # fmt: skip
    (memory,) = run_dry_run(config)
    assert "counted for a balanced router" in capsys.readouterr().out
    job = build_job(config, Runtime(4, fake_rank=0))
    try:
        shapes = _global_shapes(job)
        assert rank_memory(job) == dataclasses.replace(memory, activation_bytes=0, optimizer_step_bytes=0)
        assert memory.activation_bytes > 0 and memory.optimizer_step_bytes > 0
    finally:
        dist.destroy_process_group()
    params, grads, state = _analytic(shapes, 2, 2, _mla_tp_dim)
    assert (memory.param_bytes, memory.grad_bytes, memory.optimizer_state_bytes) == (params, grads, state)
    assert memory.param_bytes == 462_080 and sum(math.prod(s) for s in shapes.values()) == job.num_params == 446_592
    replicated = sum(math.prod(shape) for name, shape in shapes.items() if _mla_tp_dim(name) is None)
    assert replicated == 15_488 and memory.param_bytes == 2 * (replicated + (job.num_params - replicated) // 2)


# DeepSeek-V3's own pretraining layout (2,048 GPUs: 16 pipeline stages, experts over 64 ranks of the 128-way data
# parallelism, ZeRO-1), with its multi-token prediction module and its vocabulary, on 80 GB GPUs.
DEEPSEEK_V3_671B_LAYOUT = (
    "--model.name", "deepseek_v3", "--model.flavor", "671B", "--model.mtp_depth", "1", "--model.vocab_size", "129280",
    "--training.dataset", "synthetic", "--training.mixed_precision_param", "bfloat16",
    "--parallelism.pipeline_parallel_degree", "16", "--parallelism.data_parallel_degree", "128",
    "--parallelism.expert_parallel_degree", "64", "--optimizer.zero_stage", "1",
    "--activation_checkpoint.mode", "full", "--training.seq_len", "4096", "--training.local_batch_size", "1",
    "--training.global_batch_size", "2048", "--job.dry_run_gpu", "h100-80gb", "--job.dry_run_rank", "0,1920",
)  # fmt: skip


def test_deepseek_v3_671B_at_its_pretraining_layout_fits_80GB_gpus():
    """The first stage (the embedding, the 3 dense blocks and one MoE block) and the last (3 MoE blocks, the output
    layer, the multi-token prediction depth and its embedding copy) hold their bf16 parameters with the routed experts
    split 64 ways: 5.75 and 6.69 GiB measured, each equal to the stage's parameters counted here; 48.01 and 50.89 GiB
    in all, the activations of a balanced router included."""
    config = _config(*DEEPSEEK_V3_671B_LAYOUT)
    first, last = run_dry_run(config)
    with torch.device("meta"):
        model = DeepSeekV3Transformer(
            dataclasses.replace(DEEPSEEK_V3_FLAVORS["671B"], mtp_depth=1, vocab_size=129280, max_seq_len=4096)
        )

    def stage_bytes(prefixes: tuple[str, ...]) -> int:
        return sum(
            2 * param.numel() // (64 if ".experts." in name else 1)
            for name, param in model.named_parameters(remove_duplicate=False)
            if name.startswith(prefixes)
        )

    assert first.param_bytes == stage_bytes(("tok_embeddings.", *(f"layers.{i}." for i in range(4))))
    assert last.param_bytes == stage_bytes(("layers.58.", "layers.59.", "layers.60.", "norm.", "output.", "mtp"))
    assert max(first.total_bytes, last.total_bytes) < 72 * 2**30


def test_a_transformers_model_tied_across_pipeline_stages_dry_runs():
    """model.name = 'hf' (Qwen2, tied embeddings) at pp2 x tp2 x dp2: each stage holds one copy of the tied weight,
    and the optimizer step that sums the copies' gradients across stages runs on meta (it crashed there: meta
    tensors have nothing to exchange). The stages hold the whole model once, each copy of the tied weight once."""
    pytest.importorskip("transformers")
    config = _config(
        "--model.name", "hf",
        "--model.hf_config", "assets/hf_configs/qwen2_tiny.json",
        "--parallelism.tensor_parallel_degree", "2",
        "--parallelism.pipeline_parallel_degree", "2",
        "--training.seq_len", "32",
    )  # fmt: skip
    ranks = dry_run_ranks(config, 8)
    results = [probe_rank(config, 8, rank)[0] for rank in ranks]
    assert [(memory.pp, memory.tp) for memory in results] == [(0, 0), (1, 0)]
    args = hf_args(config, 2048, 32)
    with torch.device("meta"):
        whole = sum(p.numel() for p in HFCausalLM(args).parameters())  # the tied weight once
    tied = args.vocab_size * args.dim
    # fp32 parameters: tensor-parallel halves of all but the norms (replicated, hidden_size values each)
    norms = args.dim * (2 * args.n_layers + 1)
    held = sum(memory.param_bytes for memory in results) // 4
    assert held == (whole + tied - norms) // 2 + norms


def test_context_parallel_ranks_hold_their_share_of_the_sequence_and_the_gathered_keys():
    """The probe runs seq / cp positions per rank, through the gathered attention (on the fake process group) as a
    GPU runs it: each query chunk's causal kernel over the keys up to it, no mask (a [seq / cp, seq] additive mask
    per layer would add 0.75 GiB at cp2). The activations shrink with cp, a little less than 1 / cp since each rank
    also holds the whole sequence's keys and values of a layer. Measured for the debug model at seq 8192 (fp32):
    1.20 GiB on one process, 0.65 at cp2 (0.54 x) and 0.35 at cp4 (0.29 x)."""
    seq = 8192

    def activations(cp: int) -> int:
        config = _config("--model.flavor", "debugmodel", "--training.seq_len", str(seq), "--training.local_batch_size",
                         "1", "--parallelism.context_parallel_degree", str(cp), "--job.dry_run_world_size", str(cp))
        (memory,) = run_dry_run(config)
        return memory.activation_bytes

    one, cp2, cp4 = activations(1), activations(2), activations(4)
    assert one / 2 < cp2 < 0.55 * one
    assert one / 4 < cp4 < 0.3 * one


def test_the_chunked_loss_drops_the_whole_logits_from_the_activations():
    """training.loss_chunk_size: the dry run builds the chunked output layer and probes its loss, so the logits
    (here 0.5 GiB in fp32: 4,096 tokens x 32,768 ids), their fp32 log-softmax and gradient leave the backward's peak.
    Measured for the debug model under full AC: 1.54 GiB of activations whole, 0.13 GiB with 512-token chunks."""
    vocab, seq = 32768, 4096

    def activations(chunk_size: int) -> int:
        config = _config("--model.flavor", "debugmodel", "--model.vocab_size", str(vocab), "--training.seq_len",
                         str(seq), "--training.local_batch_size", "1", "--activation_checkpoint.mode", "full",
                         "--job.dry_run_world_size", "1", "--training.loss_chunk_size", str(chunk_size))  # fmt: skip
        (memory,) = run_dry_run(config)
        return memory.activation_bytes

    whole, chunked = activations(0), activations(512)
    logits = 4 * seq * vocab
    assert whole - chunked >= 2 * logits, (whole, chunked)
    assert chunked <= whole / 8, (whole, chunked)
