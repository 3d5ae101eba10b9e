"""The activation probe counts on the meta device what a CPU run holds: the same saved and transient bytes (exactly:
both run the same ops on tensors of the same sizes), the FLOPs of the model's analytic count, less under activation
checkpointing, and the tensor-parallel collectives and per-rank bytes of a fake two-rank world. Where a GPU keeps
other tensors than CPU, the probe counts the GPU's on both: attention as flash attention, torch's RMSNorm as CUDA's
fused kernel (a CPU run outside the probe keeps the norm's fp32 decomposition)."""

import dataclasses
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._subclasses import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from torchpre.distributed.parallel_dims import ParallelDims
from torchpre.models.llama3.args import LLAMA3_FLAVORS, flops_per_token
from torchpre.models.llama3.model import Transformer
from torchpre.models.llama3.parallelize import apply_llama3_tensor_parallel
from torchpre.models.registry import get_model_spec
from torchpre.parallel import ParallelPlan, parallelize
from torchpre.parallel.activation_checkpoint import apply_activation_checkpointing, slots
from torchpre.planner.activation_probe import ActivationProbe, ProbedCollective, cuda_rms_norm, probe_microbatch

ARGS = dataclasses.replace(LLAMA3_FLAVORS["tiny"], max_seq_len=32)  # dim 64, 2 blocks, 4 heads, 2 kv heads
BATCH, SEQ = 2, 32


def tiny_llama(device: str, ac_mode: str = "none") -> Transformer:
    with torch.device(device):
        model = Transformer(ARGS)
    apply_activation_checkpointing(slots(model.layers), ac_mode, "op")
    return model


def probe(device: str, ac_mode: str = "none") -> ActivationProbe:
    tokens = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ), device=device)
    return probe_microbatch(tiny_llama(device, ac_mode), (tokens,))


@pytest.mark.parametrize("ac_mode", ["none", "full", "selective"])
def test_meta_counts_the_bytes_and_flops_of_a_cpu_run(ac_mode: str) -> None:
    """Exact equality: meta runs the ops CPU runs (attention included, as the CPU flash kernel), so every storage
    has the same size at the same moment."""
    on_cpu, on_meta = probe("cpu", ac_mode), probe("meta", ac_mode)
    assert on_meta.saved_bytes > 0 and on_meta.transient_bytes > 0
    for name in ("saved_bytes", "transient_bytes", "grad_bytes", "flops", "matmul_flops", "other_bytes"):
        assert getattr(on_meta, name) == getattr(on_cpu, name), name
    assert on_meta.op_counts == on_cpu.op_counts


def test_fake_tensors_count_the_same_as_meta() -> None:
    """Under FakeTensorMode (for what cannot run on meta, such as FSDP2's lazy init) the probe counts the fake
    CPU storages: the same numbers, the job's fake mode not being mistaken for DTensor's shape propagation."""
    with FakeTensorMode():
        on_fake = probe("cpu")
    on_meta = probe("meta")
    assert (on_fake.saved_bytes, on_fake.transient_bytes, on_fake.flops) == (
        on_meta.saved_bytes, on_meta.transient_bytes, on_meta.flops)
    assert on_fake.saved_bytes > 0


def test_meta_attention_runs_the_cpu_flash_kernel() -> None:
    """Without the probe's substitution meta SDPA would run the math backend (bmm, softmax) and keep the
    [batch, heads, seq, seq] probabilities: one flash forward and backward per block, and no softmax."""
    counts = probe("meta").op_counts
    assert counts["aten._scaled_dot_product_flash_attention_for_cpu"] == ARGS.n_layers
    assert counts["aten._scaled_dot_product_flash_attention_for_cpu_backward"] == ARGS.n_layers
    assert counts["aten._safe_softmax"] == counts["aten.bmm"] == 0


class _NormOfACopy(nn.Module):
    """torch's RMSNorm of a tensor made in the probe (a copy of the input), so that what the norm keeps is counted."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dim, dtype=torch.bfloat16, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.clone())


def test_the_probe_saves_what_cudas_fused_rms_norm_saves() -> None:
    """CUDA's `_fused_rms_norm` keeps the bf16 input and an fp32 reciprocal RMS per row (and the weight, which existed
    before); CPU's decomposition would keep an fp32 copy of the input and the fp32 normalized output, 4 x the input.
    Besides the norm's, the loss and backward's seed gradient (two fp32 scalars) are live when backward starts."""
    rows, dim = 2 * 32, 64
    x = torch.empty(2, 32, dim, dtype=torch.bfloat16, device="meta", requires_grad=True)
    result = probe_microbatch(_NormOfACopy(dim), (x,), loss_fn=lambda out: out.float().sum())
    assert result.saved_bytes == 2 * rows * dim + 4 * rows + 2 * 4
    assert result.op_counts["aten.rsqrt"] == 1


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("normalized_shape", [(64,), (4, 64)])
def test_the_probes_rms_norm_has_torchs_output_and_gradients(dtype: torch.dtype, normalized_shape: tuple) -> None:
    """A probe that computes (on CPU) trains as torch's RMSNorm does: the same output, and the input's and weight's
    gradients within fp64 rounding (bf16: equal, both accumulate in fp32 and round once); also without a weight."""
    torch.manual_seed(0)
    x = torch.randn(3, 5, 4, 64, dtype=dtype, requires_grad=True)
    weight = torch.randn(normalized_shape, dtype=dtype, requires_grad=True)
    grad = torch.randn(3, 5, 4, 64, dtype=dtype)
    for w in (weight, None):
        inputs = (x,) if w is None else (x, w)
        expected = F.rms_norm(x, list(normalized_shape), w, 1e-5)
        expected_grads = torch.autograd.grad(expected, inputs, grad)
        with cuda_rms_norm():
            output = F.rms_norm(x, list(normalized_shape), w, 1e-5)
        grads = torch.autograd.grad(output, inputs, grad)
        assert torch.equal(output, expected)
        tolerance = 1e-12 if dtype == torch.float64 else 0.0
        for got, want in zip(grads, expected_grads):
            torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


def test_a_boolean_attention_mask_runs_the_same_kernel_on_meta_and_cpu() -> None:
    """Packed documents: SDPA turns the boolean mask into an additive one, then runs the flash kernel; meta too."""
    results = []
    for device in ("cpu", "meta"):
        document_ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device=device)
        tokens = torch.zeros(BATCH, SEQ, dtype=torch.long, device=device)
        results.append(probe_microbatch(tiny_llama(device), (tokens,), {"document_ids": document_ids}))
    on_cpu, on_meta = results
    assert on_meta.saved_bytes == on_cpu.saved_bytes and on_meta.transient_bytes == on_cpu.transient_bytes
    assert on_meta.op_counts == on_cpu.op_counts


def test_flops_match_the_analytic_count() -> None:
    """Exact, with three stated differences from `flops_per_token` (the MFU convention): its dense term 6 x params
    includes the norm weights, which do no matmul (the probe counts only matmuls and attention); its attention term
    12 x layers x dim x seq counts the backward as twice the forward, where flash attention's backward also
    recomputes the scores (torch's formula: 5 matmuls of the score size against 2 in forward, i.e. 14 not 12); and
    it counts the full score matrix, where the probe counts what a causal flash kernel computes: the scores on and
    below the diagonal, 1 - (seq - 1) / (2 seq) of them (each op's count rounded to an integer)."""
    model = tiny_llama("meta")
    tokens = BATCH * SEQ
    num_params = sum(p.numel() for p in model.parameters())
    norm_params = sum(p.numel() for name, p in model.named_parameters() if "norm" in name)
    result = probe("meta")
    assert result.matmul_flops == tokens * (flops_per_token(ARGS, num_params, SEQ) - 6 * norm_params
                                            - 12 * ARGS.n_layers * ARGS.dim * SEQ)  # fmt: skip
    causal_share = 1 - (SEQ - 1) / (2 * SEQ)
    attention = 14 * ARGS.n_layers * ARGS.dim * SEQ * tokens * causal_share
    assert abs(result.flops - result.matmul_flops - attention) <= 2 * ARGS.n_layers  # forward and backward per layer


def test_full_activation_checkpointing_saves_less_and_recomputes_the_blocks() -> None:
    """Recomputation is one more forward of each block up to its last needed tensor: torch's non-reentrant
    checkpoint stops once backward has every saved tensor back, so each block's final matmul (w2, whose output
    nothing saves) is not rerun. That is 2 FLOPs per token per weight of the other linear layers, plus attention's
    causal forward (2 matmuls of 2 x dim x seq per token, on the scores on and below the diagonal: each layer's
    count rounded to an integer)."""
    none, full = probe("meta"), probe("meta", "full")
    assert full.saved_bytes < none.saved_bytes
    model = tiny_llama("meta")
    rerun = sum(p.numel() for name, p in model.layers.named_parameters() if "norm" not in name and "w2" not in name)
    tokens = BATCH * SEQ
    causal_attention = 4 * ARGS.n_layers * ARGS.dim * SEQ * tokens * (1 - (SEQ - 1) / (2 * SEQ))
    assert abs(full.flops - none.flops - tokens * 2 * rerun - causal_attention) <= ARGS.n_layers


def test_the_recomputation_under_full_checkpointing_is_traced() -> None:
    """`recomputed_trace` follows the bytes activation checkpointing's recomputation made, entry by entry with the
    transient trace. Without AC nothing is recomputed; under full AC its largest value is one block's recomputation
    whole: what the block saves without AC (probed alone: beyond its input, and the loss and seed scalars) less
    what its two norms make inside their autograd.Function's forward, which runs without grad (the normalized
    output, fp32 here, and the reciprocal RMS per row)."""
    none, full = probe("meta"), probe("meta", "full")
    assert len(full.recomputed_trace) == len(full.transient_trace)
    assert max(none.recomputed_trace) == 0
    with torch.device("meta"):
        model = Transformer(ARGS)
    x = torch.empty(BATCH, SEQ, ARGS.dim, device="meta", requires_grad=True)
    block = probe_microbatch(model.layers["0"], (x, model.rope_cache), loss_fn=lambda out: out.sum())
    rows = BATCH * SEQ
    norms = 2 * (4 * rows * ARGS.dim + 4 * rows)
    assert max(full.recomputed_trace) == block.saved_bytes - 2 * 4 - norms


def test_saved_bytes_of_a_two_layer_mlp_by_hand() -> None:
    """What backward keeps of linear -> relu -> linear on a [3, 8] batch: relu's output (relu's backward and the
    second layer's weight gradient read it) and the held output, fp32; the first layer's output dies inside the
    forward. The weights and the batch existed before the probe and are not counted though ops view them
    (weight.t()). The peak comes in backward: on top of the saved bytes, the gradient reaching relu's output and the
    one relu's backward makes, both [3, 16]; the parameter gradients are `grad_bytes`, not transient."""
    with torch.device("meta"):
        mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    result = probe_microbatch(mlp, (torch.empty(3, 8, device="meta"),))
    assert result.saved_bytes == 4 * (3 * 16 + 3 * 4)
    assert result.transient_bytes == 4 * 2 * 3 * 16
    assert result.grad_bytes == 4 * sum(p.numel() for p in mlp.parameters())


def test_parameter_gradients_are_reported_apart_from_activations() -> None:
    """The fp32 gradient of every parameter, created by backward and still in .grad, is `grad_bytes`, not
    transient; a second probe adds into the existing .grad and creates none."""
    model = tiny_llama("meta")
    tokens = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")
    first = probe_microbatch(model, (tokens,))
    assert first.grad_bytes == 4 * sum(p.numel() for p in model.parameters())
    second = probe_microbatch(model, (tokens,))
    assert second.grad_bytes == 0
    assert second.saved_bytes == first.saved_bytes


def test_a_loss_fn_starts_the_backward_without_holding_the_logits() -> None:
    """As in the trainer, the logits live only as long as the loss needs them: cross-entropy saves its
    log-softmax (the logits' size) instead, so the saved bytes are those of the output-gradient probe (which holds
    the logits until backward, as a pipeline stage holds its output) plus three fp32 scalars: the loss, nll_loss's
    total weight and backward's seed gradient. Holding the logits too would add 4 x batch x seq x vocab bytes."""
    model = tiny_llama("meta")
    tokens = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")
    labels = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")
    plain = probe_microbatch(model, (tokens,))
    model.zero_grad(set_to_none=True)
    with_loss = probe_microbatch(
        model, (tokens,), loss_fn=lambda logits: nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    )
    assert with_loss.saved_bytes - plain.saved_bytes == 3 * 4
    assert with_loss.op_counts["aten._log_softmax"] == 1


@pytest.fixture
def tp2_mesh():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield ParallelDims.from_degrees(dp=1, tp=2, pp=1, world_size=2).build_mesh("cpu")
    finally:
        dist.destroy_process_group()


def tp_probe(mesh, sequence_parallel: bool) -> ActivationProbe:
    def shard(part: nn.Module, tp_mesh) -> None:
        apply_llama3_tensor_parallel(part, tp_mesh, sequence_parallel=sequence_parallel, loss_parallel=False)

    parallel = parallelize(tiny_llama("meta"), mesh, ParallelPlan(tensor_parallel=shard),
                           device=torch.device("meta"), init_weights=lambda part: None)
    return probe_microbatch(parallel.parts[0], (torch.empty(BATCH, SEQ, dtype=torch.long, device="meta"),))


def test_tensor_parallel_all_reduces_and_per_rank_bytes(tp2_mesh) -> None:
    """Megatron TP without sequence parallelism, by hand: forward all-reduces the vocab-parallel embedding's output
    and each block's attention and feed-forward outputs (1 + 2 x layers), and all-gathers the vocab-sharded logits
    (this rank's half: [batch, seq, vocab / 2]); backward all-reduces the input gradients of the column-parallel
    layers: each block's attention and feed-forward inputs and the output layer's (2 x layers + 1). Every
    all-reduce carries one [batch, seq, dim] fp32 activation. The matmuls and attention split evenly: FLOPs
    halve exactly."""
    result = tp_probe(tp2_mesh, sequence_parallel=False)
    activation = 4 * BATCH * SEQ * ARGS.dim
    assert Counter(result.collectives) == {
        ProbedCollective("_c10d_functional.all_reduce", 2, activation): 2 * (1 + 2 * ARGS.n_layers),
        ProbedCollective("_c10d_functional.all_gather_into_tensor", 2, 4 * BATCH * SEQ * ARGS.vocab_size // 2): 1,
    }
    tp1 = probe("meta")
    assert result.saved_bytes < tp1.saved_bytes
    assert result.flops * 2 == tp1.flops


def test_sequence_parallel_turns_all_reduces_into_reduce_scatters_and_all_gathers(tp2_mesh) -> None:
    """Under SP each of the 2 x layers + 1 forward all-reduces becomes a reduce-scatter of the whole activation
    (the embedding's and the blocks') and each block input an all-gather of this rank's half; backward mirrors it.
    The residual stream is halved, so the saved bytes fall below TP alone."""
    result = tp_probe(tp2_mesh, sequence_parallel=True)
    activation = 4 * BATCH * SEQ * ARGS.dim
    counts, per_direction = Counter(result.collectives), 1 + 2 * ARGS.n_layers
    assert counts[ProbedCollective("_c10d_functional.reduce_scatter_tensor", 2, activation)] == 2 * per_direction
    assert counts[ProbedCollective("_c10d_functional.all_gather_into_tensor", 2, activation // 2)] == 2 * per_direction
    assert result.saved_bytes < tp_probe(tp2_mesh, sequence_parallel=False).saved_bytes


class AllReduceInForward(nn.Module):
    """A module that calls the c10d API itself (as a hand-written data-parallel wrapper would)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        dist.all_reduce(y.detach())
        return y


def test_c10d_collectives_are_recorded_with_their_group_size(tp2_mesh) -> None:
    result = probe_microbatch(AllReduceInForward(), (torch.empty(3, 8, device="meta"),))
    assert result.collectives == [ProbedCollective("c10d.allreduce_", 2, 4 * 3 * 8)]


@pytest.mark.parametrize("family", ["moe", "deepseek_v3"])
def test_a_router_counts_on_meta_as_balanced(family: str) -> None:
    """Meta tensors hold no routing decisions, so the experts get equal shares of the routed rows there
    (`counts_on_host`). What the experts save, the gradients and the FLOPs depend on the total rows only: equal to a
    CPU run's, whose router is not balanced. The largest transient (one expert's intermediate) may differ: measured
    0.72% (moe) and 0.42% (deepseek_v3) with these seeded tokens; unseeded, they followed the tests run before and
    once differed by 1.6%."""
    spec = get_model_spec(family)
    args = dataclasses.replace(spec.flavors["debugmodel"], max_seq_len=SEQ, vocab_size=256)
    probes = []
    for device in ("cpu", "meta"):
        with torch.device(device):
            model = spec.build.model_cls(args)
        if device == "cpu":
            model.init_weights(0)
        tokens = torch.randint(0, args.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
        probes.append(probe_microbatch(model, (tokens.to(device),), devices=(device,)))
    on_cpu, on_meta = probes
    for name in ("saved_bytes", "grad_bytes", "flops", "matmul_flops"):
        assert getattr(on_meta, name) == getattr(on_cpu, name), name
    assert abs(on_meta.transient_bytes / on_cpu.transient_bytes - 1) < 0.01
