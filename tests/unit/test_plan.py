"""The planner: layouts through start-up's own checks, memory equal to the dry run's, the JSON users rely on."""

import dataclasses
import json
import logging
import subprocess
import sys
from types import SimpleNamespace

import pytest

from torchpre.assembly.meta import meta_model
from torchpre.config.job_config import JobConfig
from torchpre.config.parser import parse_args, to_toml
from torchpre.distributed.parallel_dims import ParallelDims
from torchpre.errors import ConfigError
from torchpre.models.registry import get_model_spec
from torchpre.plan import main as plan_main
from torchpre.planner import layout_space, stage_costs
from torchpre.planner import search as search_module
from torchpre.planner.allocator import COMPILED_SAVED_KEPT
from torchpre.planner.cost_cache import microbatch_costs, microbatch_key, state_key
from torchpre.planner.dryrun import build_rank, probe_rank_parts
from torchpre.planner.dryrun import probe_rank as build_and_probe
from torchpre.planner.hardware import get_hardware
from torchpre.planner.layout_space import Layout, check, valid_layouts
from torchpre.planner.predict import model_flops_per_token, predict
from torchpre.planner.search import needs_context_parallel, search
from torchpre.planner.stage_costs import microbatch_pieces
from torchpre.planner.time_model import collective_seconds
from torchpre.step_rules.schedules import names_where

JSON_KEYS = {
    "dp", "tp", "pp", "ep", "zero_stage", "activation_checkpoint", "microbatch_size", "schedule", "memory_bytes",
    "param_bytes", "grad_bytes", "optimizer_state_bytes", "activation_bytes", "step_time_s", "tokens_per_sec", "mfu",
    "fits", "cp", "memory_gib", "tensor_memory_gib", "tokens_per_s_per_gpu", "error_bars",
}  # fmt: skip


@pytest.fixture(autouse=True)
def quiet():
    logging.getLogger("torchpre").setLevel(logging.WARNING)
    yield
    logging.getLogger("torchpre").setLevel(logging.INFO)


def _job(*argv: str) -> JobConfig:
    return parse_args(JobConfig, list(argv))


def test_every_layout_is_one_start_up_accepts():
    base = _job("--model.flavor", "debugmodel", "--training.global_batch_size", "16")
    valid, refusals = valid_layouts(base, 8, 8)
    assert sum(refusals.values()) > 0  # e.g. fewer microbatches than a schedule needs
    for checked in valid:
        layout, p = checked.layout, checked.config.parallelism
        dims = ParallelDims.from_degrees(p.data_parallel_degree, p.tensor_parallel_degree,
                                         p.pipeline_parallel_degree, 8)  # fmt: skip
        assert (dims.dp, dims.tp, dims.pp) == (layout.dp, layout.tp, layout.pp)
        assert checked.config.training.global_batch_size == 16
    schedules = {c.layout.schedule for c in valid if c.layout.pp > 1}
    assert schedules == {"1F1B", "GPipe", "Interleaved1F1B", "ZBVZeroBubble"}
    with pytest.raises(ConfigError, match="n_heads = 16 is not divisible"):  # what start-up says, unchanged
        check(Layout(dp=1, tp=3, pp=1), base, 3)


def test_a_search_with_the_mlp_activation_recomputed_keeps_it_where_blocks_are_not_checkpointed():
    """activation_checkpoint.recompute_mlp_activation is refused with checkpointed blocks (they recompute it
    already): a search for a job that sets it tries every AC mode, with the key kept only where there is no AC."""
    base = _job("--model.flavor", "debugmodel", "--training.global_batch_size", "16",
                "--activation_checkpoint.recompute_mlp_activation")  # fmt: skip
    valid, _ = valid_layouts(base, 8, 8)
    modes = {c.layout.activation_checkpoint: c.config.activation_checkpoint.recompute_mlp_activation for c in valid}
    assert modes == {"none": True, "selective": False, "full": False}


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(Layout(dp=4, tp=8, pp=2, zero_stage=1, activation_checkpoint="full", schedule="1F1B"), id="pp2",
                     marks=pytest.mark.plan_matrix),  # fmt: skip
        pytest.param(Layout(dp=2, tp=8, pp=4, zero_stage=3, activation_checkpoint="selective",
                            schedule="Interleaved1F1B", virtual_stages=2), id="pp4-interleaved-zero3"),  # fmt: skip
        pytest.param(Layout(dp=8, tp=8, pp=1, zero_stage=2, activation_checkpoint="none", microbatch_size=2),
                     id="dp8-zero2", marks=pytest.mark.plan_matrix),  # fmt: skip
    ],
)
def test_planner_memory_is_the_dry_runs(layout):
    """8B at 64 ranks: the planner's per-rank bytes (shortened-model pieces) against a full dry run of each
    pipeline rank. Exact for the model state; activations within 0.5% (a whole model keeps its first stage's
    output once, the pieces' first stage counts it as the output it sends: one [mb, seq, dim] tensor). CI runs the
    interleaved ZeRO-3 case (every kind of piece: chunks, FSDP gathers); `-m plan_matrix` all three."""
    base = _job("--model.flavor", "8B", "--training.seq_len", "2048", "--training.global_batch_size", "64",
                "--training.mixed_precision_param", "bfloat16")  # fmt: skip
    checked = check(layout, base, 64)
    prediction = predict(checked, get_hardware("h100-80gb"), 64, model_flops_per_token(checked.config,
                                                                                        checked.model_args))
    for pp_rank, rank in enumerate(prediction.ranks):
        real = build_rank(checked.config, 64, pp_rank * layout.dp * layout.tp, checkpoint=False)
        assert (rank.param_bytes, rank.grad_bytes, rank.optimizer_state_bytes) == (
            real.param_bytes, real.grad_bytes, real.optimizer_state_bytes)  # fmt: skip
        assert rank.optimizer_step_bytes == pytest.approx(real.optimizer_step_bytes, rel=0.005)
        assert rank.activation_bytes == pytest.approx(real.activation_bytes, rel=0.005)
    assert prediction.step.total_s > 0 and 0 < prediction.mfu < 1


def test_the_planner_prices_fsdp_units_per_sublayer_as_the_dry_run():
    """parallelism.fsdp_wrap = "sublayer": FSDP2 holds one block gathered at the peak instead of two (the running
    sub-layer, the prefetched one and the block's norms; tests/distributed/test_fsdp_sublayer.py counts it on
    gloo). 8B at dp8 x tp8 with ZeRO-3 without pipelining (resharded after forward): the planner's activations
    against a dry run of each wrapping (equal), and the difference one bf16 block's tp8 shard."""
    layout = Layout(dp=8, tp=8, pp=1, zero_stage=3, activation_checkpoint="full")
    predicted, real = {}, {}
    for wrap in ("block", "sublayer"):
        base = _job("--model.flavor", "8B", "--training.seq_len", "2048", "--training.global_batch_size", "64",
                    "--training.mixed_precision_param", "bfloat16", "--parallelism.fsdp_wrap", wrap)  # fmt: skip
        checked = check(layout, base, 64)
        flops = model_flops_per_token(checked.config, checked.model_args)
        predicted[wrap] = predict(checked, get_hardware("h100-80gb"), 64, flops).ranks[0].activation_bytes
        real[wrap] = build_rank(checked.config, 64, 0, checkpoint=False).activation_bytes
        assert predicted[wrap] == pytest.approx(real[wrap], rel=0.005), wrap
    # 4096 x (4096 + 2 x 1024 + 4096) attention + 3 x 4096 x 14,336 feed-forward over tp8, two norms of 4096 whole
    one_block = (218_103_808 // 8 + 2 * 4096) * 2
    assert predicted["block"] - predicted["sublayer"] == real["block"] - real["sublayer"] == one_block


def test_a_compiled_block_under_full_checkpointing_recomputes_what_compile_keeps():
    """Under full AC a block saves its input only, eager or compiled, but backward recomputes one block at a time,
    and a compiled block's recomputation keeps `COMPILED_SAVED_KEPT["none"]` of the eager one's tensors. The debug
    model over two 1F1B stages, bf16, 2,048 tokens: the first rank's transient peaks in a block's backward, where
    the eager probe holds 13.8 MB that recomputation made (of the 19.0 MB an uncheckpointed block saves beyond its
    input: some are freed by then, and the norms' outputs come from an autograd.Function's forward, made without
    grad); compiled, 0.17 of it less. The last rank's peak is the loss's, which compile leaves as it is."""
    predicted, probed = {}, {}
    for compiled in ("false", "true"):
        base = _job("--model.flavor", "debugmodel", "--training.seq_len", "2048", "--training.global_batch_size", "4",
                    "--training.mixed_precision_param", "bfloat16", "--compile.enable", compiled)  # fmt: skip
        checked = check(Layout(dp=1, tp=1, pp=2, activation_checkpoint="full", schedule="1F1B"), base, 2)
        flops = model_flops_per_token(checked.config, checked.model_args)
        predicted[compiled] = [r.activation_bytes for r in predict(checked, get_hardware("h100-80gb"), 2, flops).ranks]
        probed[compiled] = probe_rank_parts(stage_costs.microbatch_config(checked.config, 1), 2, 0)[0].total
    eager = probed["false"]
    assert probed["true"] == eager  # the probe runs compiled blocks eager
    peak = max(range(len(eager.transient_trace)), key=eager.transient_trace.__getitem__)
    assert eager.recomputed_trace[peak] == 13_762_560
    spared = (1 - COMPILED_SAVED_KEPT["none"]) * eager.recomputed_trace[peak]
    assert predicted["false"][0] - predicted["true"][0] == pytest.approx(spared, abs=1)
    assert predicted["false"][1] == predicted["true"][1]


def test_the_planner_counts_the_chunked_loss_as_the_dry_run_does():
    """training.loss_chunk_size: the planner's pieces build the chunked output layer as start-up does, so its last
    stage's activations are the dry run's and lose the whole logits. tp2 x pp2 (vocabulary-parallel chunks), the debug
    model at 32,768 ids and 2,048 tokens; measured: the last stage's 678.5 MB whole, 35.7 MB with 256-token chunks."""
    layout = Layout(dp=1, tp=2, pp=2, zero_stage=1, activation_checkpoint="full", schedule="1F1B")
    last_stage = []
    for chunk_size in ("0", "256"):
        base = _job("--model.flavor", "debugmodel", "--model.vocab_size", "32768", "--training.seq_len", "2048",
                    "--training.global_batch_size", "4", "--training.loss_chunk_size", chunk_size)  # fmt: skip
        checked = check(layout, base, 4)
        flops = model_flops_per_token(checked.config, checked.model_args)
        predicted = predict(checked, get_hardware("h100-80gb"), 4, flops).ranks[-1]
        real = build_rank(checked.config, 4, layout.dp * layout.tp, checkpoint=False)
        assert predicted.activation_bytes == pytest.approx(real.activation_bytes, rel=0.005)
        last_stage.append(real.activation_bytes)
    whole, chunked = last_stage
    assert chunked <= whole / 8, last_stage


DSV3_671B = ("--model.name", "deepseek_v3", "--model.flavor", "671B", "--model.mtp_depth", "1", "--model.vocab_size",
             "129280", "--training.dataset", "synthetic", "--training.mixed_precision_param", "bfloat16",
             "--training.seq_len", "4096", "--training.global_batch_size", "2048")  # fmt: skip


@pytest.mark.parametrize(
    "argv, layout, world, ranks",
    [
        pytest.param(("--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--training.seq_len", "64",
                      "--training.global_batch_size", "16"),
                     Layout(dp=4, tp=1, pp=2, ep=2, zero_stage=1, schedule="1F1B"), 8, (0, 1),
                     id="deepseek_v3-pp2-ep2"),  # fmt: skip
        pytest.param(("--model.name", "moe", "--model.flavor", "debugmodel", "--training.seq_len", "64",
                      "--training.global_batch_size", "16"),
                     Layout(dp=2, tp=2, pp=2, ep=2, zero_stage=3, activation_checkpoint="full", schedule="1F1B"), 8,
                     (0, 1), id="moe-tp2-pp2-ep2-zero3", marks=pytest.mark.plan_matrix),  # fmt: skip
        pytest.param(DSV3_671B, Layout(dp=128, tp=1, pp=16, ep=64, zero_stage=1, activation_checkpoint="full",
                                       schedule="1F1B"), 2048, (0, 15),
                     id="deepseek_v3-671B-pp16-ep64", marks=pytest.mark.plan_matrix),  # fmt: skip
    ],
)
def test_moe_planner_memory_is_the_dry_runs(argv, layout, world, ranks):
    """The MoE families under expert parallelism: the planner's per-rank bytes (pieces of shortened models whose
    first stage holds the dense first blocks) against full dry runs of those pipeline ranks. The model state is
    exact; the activations within 4% (measured: 3.7% on the debug model's first stage, exact elsewhere: its
    transient is taken from a first stage of the dense block alone, 144 KB, whose backward peaks after the norms'
    saves are freed, where the two-block stage peaks at 74 KB beyond its saved bytes; 0.99% when the probe counted
    the norms' fp32 decomposition); the total within 4% (the optimizer step's transient is measured on the first
    stage and taken for every stage: on the debug model's last stage 11.6% above the dry run's, below its
    activations). The 671B case is DeepSeek-V3's
    own layout with its MTP module, the dry run's in docs/deepseek-v3.md: 48.01 and 50.89 GiB on the first and
    last stage, predicted exactly (13 s here, 61 s while other jobs loaded the machine)."""
    checked = check(layout, _job(*argv), world)
    prediction = predict(checked, get_hardware("h100-80gb"), world, model_flops_per_token(checked.config,
                                                                                           checked.model_args))
    assert prediction.step.ep_comm_s > 0
    for pp_rank in ranks:
        rank = prediction.ranks[pp_rank]
        real = build_rank(checked.config, world, pp_rank * world // layout.pp, checkpoint=False)
        assert (rank.param_bytes, rank.grad_bytes, rank.optimizer_state_bytes) == (
            real.param_bytes, real.grad_bytes, real.optimizer_state_bytes)  # fmt: skip
        assert rank.activation_bytes == pytest.approx(real.activation_bytes, rel=0.04)
        assert rank.total_bytes == pytest.approx(real.total_bytes, rel=0.04)


def test_the_json_lists_every_layout_with_the_keys_users_rely_on(capsys, monkeypatch):
    """The tiny model on 2 GPUs, the search cut to ZeRO-1 and -3, no activation checkpointing, 1 or 2 sequences per
    microbatch and 1F1B (12 layouts, each kind of layout: dp2, tp2, pp2)."""
    _narrow(monkeypatch, tp=(1, 2), pp=(1, 2), ZERO_STAGES=(1, 3), AC_MODES=("none",), MICROBATCH_SIZES=(1, 2),
            TRY_WHOLE_SHARE=False, PLANNED_SCHEDULES=(("1F1B", 1),))  # fmt: skip
    plan_main(["--model.flavor", "tiny", "--training.seq_len", "32", "--training.global_batch_size", "8",
               "--gpus", "2", "--gpu", "a100-80gb", "--json", "--workers", "1"])  # fmt: skip
    result = json.loads(capsys.readouterr().out)
    layouts = result["layouts"]
    assert len(layouts) == result["valid_layouts"] == 12
    for layout in layouts:
        assert JSON_KEYS <= set(layout), JSON_KEYS - set(layout)
        state = layout["param_bytes"] + layout["grad_bytes"] + layout["optimizer_state_bytes"]
        assert layout["memory_bytes"] == state + max(layout["activation_bytes"], layout["optimizer_step_bytes"])
    rates = [layout["tokens_per_sec"] for layout in layouts if layout["fits"]]
    assert rates == sorted(rates, reverse=True)  # best first
    assert {(layout["dp"], layout["tp"], layout["pp"]) for layout in layouts} == {(2, 1, 1), (1, 2, 1), (1, 1, 2)}


def test_layouts_that_start_up_refuses_are_not_offered():
    """Per-op selective AC cannot run under a zero-bubble schedule (one backward per block, and these run two):
    start-up refuses it, so the planner drops it and keeps the other AC modes under that schedule."""
    layouts, refusals = valid_layouts(_job("--model.flavor", "debugmodel", "--training.global_batch_size", "8"), 2, 8)
    split_backward = set(names_where(zero_bubble=True))
    pairs = {(checked.layout.activation_checkpoint, checked.layout.schedule) for checked in layouts}
    assert {("full", "ZBVZeroBubble"), ("none", "ZBVZeroBubble"), ("selective", "1F1B")} <= pairs
    assert not any(ac == "selective" and schedule in split_backward for ac, schedule in pairs)
    assert any("selective_ac_option = 'op' cannot run under" in message for message in refusals)


def test_with_no_valid_layout_the_planner_fails_naming_why():
    """A misnamed flavor is named as start-up names it, not hidden behind a count of refused layouts; a job no
    layout can run lists the most common refusals, and the planner exits with bad input (2)."""
    with pytest.raises(ConfigError, match="999B"):
        plan_main(["--model.flavor", "999B", "--gpus", "8", "--training.global_batch_size", "64"])
    refused = r"None of the \d+ layouts of llama3 tiny on 2 GPUs .* refusals: \(1\) \d+ of them: optimizer\.lr = -1\.0"
    with pytest.raises(ConfigError, match=refused):
        plan_main(["--model.flavor", "tiny", "--gpus", "2", "--training.global_batch_size", "4",
                   "--optimizer.lr", "-1"])  # fmt: skip


def test_the_planner_needs_the_gpu_count_a_known_gpu_and_a_flavor():
    with pytest.raises(ConfigError, match="--gpus N"):
        plan_main(["--model.flavor", "tiny", "--training.global_batch_size", "8"])
    with pytest.raises(ConfigError, match="h100-80gb"):
        plan_main(["--model.flavor", "tiny", "--gpus", "2", "--gpu", "h100"])
    with pytest.raises(ConfigError, match=r"this family's args come from elsewhere \(model.hf_config\)"):
        plan_main(["--model.name", "hf", "--model.hf_config", "assets/hf_configs/llama_tiny.json",
                   "--training.global_batch_size", "8", "--gpus", "2"])  # fmt: skip


def test_the_cp_communication_is_the_key_and_value_gathers_of_every_attention_layer():
    """The step-time model's cp term, by hand: per attention layer and microbatch, forward all-gathers k and v
    over cp (each gathered tensor: microbatch x seq x kv_heads / tp x head_dim in the compute dtype) and backward
    reduce-scatters their gradients (the same full buffers); TP's collectives stay tp's."""
    base = _job("--model.flavor", "debugmodel", "--training.seq_len", "64", "--training.global_batch_size", "8")
    checked = check(Layout(dp=1, tp=2, pp=1, cp=2, microbatch_size=2), base, 4)
    args = checked.model_args
    kv_bytes = 2 * 64 * (args.n_kv_heads // 2) * (args.dim // args.n_heads) * 4  # microbatch 2, fp32
    block = microbatch_pieces(checked.config, 2).block
    for work, op in ((block.forward, "all_gather"), (block.backward, "reduce_scatter")):
        cp = [c for c in work.collectives if c.dim == "cp"]
        assert sorted((c.op, c.bytes) for c in cp) == [(op, kv_bytes)] * 2
        assert any(c.dim == "tp" for c in work.collectives)
    step = predict(checked, get_hardware("h100-80gb"), 4, model_flops_per_token(checked.config, args)).step
    hardware = get_hardware("h100-80gb")
    per_gather = collective_seconds("all_gather", 2, kv_bytes, hardware.intra_node_bw, hardware)
    per_scatter = collective_seconds("reduce_scatter", 2, kv_bytes, hardware.intra_node_bw, hardware)
    microbatches = 8 // 2
    expected = microbatches * args.n_layers * 2 * (per_gather + per_scatter)
    assert step.cp_comm_s == pytest.approx(expected, rel=1e-9)


def test_cp_layouts_are_enumerated_for_every_degree_that_cuts_the_sequence_evenly():
    """With context parallelism asked for, every cp > 1 that divides the GPUs left by tp x pp and cuts each sequence
    into 2 x cp equal chunks, each checked by start-up (seq 40 on 8 GPUs: 2, 4 and 8 divide the world, 40 is cut
    evenly into 4 and 8 chunks but not 16)."""
    base = _job("--model.flavor", "debugmodel", "--training.seq_len", "40", "--training.global_batch_size", "8")
    with_cp, _ = valid_layouts(base, 8, 8, context_parallel=True)
    assert {c.layout.cp for c in with_cp} == {2, 4}
    assert all(c.config.parallelism.context_parallel_degree == c.layout.cp for c in with_cp)
    assert {(c.layout.tp, c.layout.cp) for c in with_cp if c.layout.pp == 1} >= {(1, 2), (1, 4), (2, 2), (2, 4), (4, 2)}


def _prediction(ac: str, fits: bool, cp: int = 1) -> SimpleNamespace:
    return SimpleNamespace(fits=fits, checked=SimpleNamespace(layout=Layout(1, 1, 1, activation_checkpoint=ac, cp=cp)))


@pytest.mark.parametrize(
    "predictions, searched",
    [
        pytest.param([_prediction("full", True), _prediction("selective", True)], False, id="selective-fits"),
        pytest.param([_prediction("full", True), _prediction("none", True)], False, id="no-ac-fits"),
        pytest.param([_prediction("full", True), _prediction("selective", False)], True, id="only-full-ac-fits"),
        pytest.param([_prediction("full", False), _prediction("none", False)], True, id="nothing-fits"),
    ],
)  # fmt: skip
def test_cp_is_searched_when_only_full_activation_checkpointing_fits(predictions, searched):
    assert needs_context_parallel(predictions) is searched


@pytest.mark.plan_matrix
def test_llama3_8b_at_128k_tokens_on_64_h100s_is_offered_cp(monkeypatch):
    """Llama 3 8B at 131,072 tokens on 64 H100s (16 sequences per step): without cp only full activation
    checkpointing fits (tp8 with per-op checkpointing needs 74.6 GiB of tensors, 87.3 of the allocator's 78.6), so the
    planner searches cp and offers cp layouts with per-op checkpointing among the fastest it prints (NeMo's recipe
    for this job: tp4 x pp2 x cp8 on 64 GPUs). Narrowed to ZeRO-3, one sequence per microbatch, no pipelining, tp4
    and tp8 (237 s here); `-s` prints the table docs/context-parallel.md shows."""
    for name, values in (("ZERO_STAGES", (3,)), ("AC_MODES", ("selective", "full")), ("MICROBATCH_SIZES", (1,)),
                         ("TRY_WHOLE_SHARE", False), ("PLANNED_SCHEDULES", ())):  # fmt: skip
        monkeypatch.setattr(layout_space, name, values)
    every = layout_space.candidates
    monkeypatch.setattr(layout_space, "candidates", lambda *args, **kwargs: (
        layout for layout in every(*args, **kwargs) if layout.tp >= 4))  # fmt: skip
    base = _job("--model.flavor", "8B", "--training.seq_len", "131072", "--training.global_batch_size", "16",
                "--training.mixed_precision_param", "bfloat16")  # fmt: skip
    result = search(base, get_hardware("h100-80gb"), 64)
    print(result.table(8))
    without_cp = [p for p in result.predictions if p.checked.layout.cp == 1]
    assert without_cp and not any(p.fits for p in without_cp if p.checked.layout.activation_checkpoint != "full")
    offered = [p.checked.layout for p in result.fitting[:5]]
    assert any(layout.cp > 1 and layout.activation_checkpoint == "selective" for layout in offered), result.table(5)


@pytest.mark.plan_matrix
def test_a_job_whose_layouts_fit_without_cp_is_not_offered_cp(monkeypatch):
    """Llama 3 8B on 64 H100s at 8,192 tokens, 64 sequences per step: layouts without cp fit without full activation
    checkpointing, so the planner does not search cp (each degree of it would add its probes and a key/value gather
    per layer). The search is narrowed to ZeRO-3, per-op AC, one sequence per microbatch and 1F1B to keep its probes
    few (112 s here)."""
    for name, values in (("ZERO_STAGES", (3,)), ("AC_MODES", ("selective",)), ("MICROBATCH_SIZES", (1,)),
                         ("TRY_WHOLE_SHARE", False), ("PLANNED_SCHEDULES", (("1F1B", 1),))):  # fmt: skip
        monkeypatch.setattr(layout_space, name, values)
    base = _job("--model.flavor", "8B", "--training.seq_len", "8192", "--training.global_batch_size", "64",
                "--training.mixed_precision_param", "bfloat16")  # fmt: skip
    result = search(base, get_hardware("h100-80gb"), 64)
    assert result.fitting and all(p.checked.layout.cp == 1 for p in result.predictions), result.table(5)


DSV3_DEBUG = ("--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--training.seq_len", "64")


def test_the_ep_communication_is_the_dispatch_and_combine_of_every_moe_layer():
    """The step-time model's ep term, by hand: per MoE layer and microbatch, forward all-to-alls the routed rows to
    their experts' ranks and back (dispatch + combine: tokens x top-k x dim in the compute dtype each, after an
    exchange of the per-expert row counts, num_experts int64s) and backward sends their gradients both ways again.
    deepseek_v3 debugmodel (3 blocks, 1 dense: 2 MoE layers; top-2 of 8 experts, dim 64), dp2 x ep2, 2 sequences
    of 64 tokens per microbatch in fp32, 2 microbatches: 128 x 2 x 64 x 4 = 65,536 bytes per all-to-all, within a
    node (NVLink)."""
    base = _job(*DSV3_DEBUG, "--training.global_batch_size", "8")
    checked = check(Layout(dp=2, tp=1, pp=1, ep=2, microbatch_size=2), base, 2)
    args = checked.model_args
    routed = 2 * 64 * args.top_k * args.dim * 4
    block = microbatch_pieces(checked.config, 2).block
    assert sorted(c.bytes for c in block.forward.collectives) == [args.num_experts * 8, routed, routed]
    assert [(c.op, c.dim, c.bytes) for c in block.backward.collectives] == [("all_to_all", "ep", routed)] * 2
    hardware = get_hardware("h100-80gb")
    step = predict(checked, hardware, 2, model_flops_per_token(checked.config, args)).step

    def all_to_all(nbytes: int) -> float:
        return collective_seconds("all_to_all", 2, nbytes, hardware.intra_node_bw, hardware)

    moe_layers, microbatches = args.n_layers - args.first_k_dense, 8 // (2 * 2)
    expected = microbatches * moe_layers * (all_to_all(args.num_experts * 8) + 4 * all_to_all(routed))
    assert step.ep_comm_s == pytest.approx(expected, rel=1e-9)
    assert step.tp_comm_s == step.cp_comm_s == 0


def _without_step(state: stage_costs.StateCost) -> stage_costs.StateCost:
    return dataclasses.replace(state, optimizer_step_bytes=0)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_expert_parallel_costs_are_interpolated_in_one_over_ep_to_the_byte(zero):
    """The state at ep8 from measurements at ep2 and ep4 (affine in 1 / ep: the local experts) equals a measurement
    at ep8, deepseek_v3 debugmodel at dp8: the state pieces to the byte at every ZeRO stage; the optimizer step's
    transient (not affine in general: its buckets) within 5% (measured: exact at 0, 1 and 3, 4.5% low at 2). One
    case per stage, each within pytest's timeout on a loaded machine."""
    base = _job(*DSV3_DEBUG, "--training.global_batch_size", "16")
    config = check(Layout(dp=8, tp=1, pp=1, ep=8, zero_stage=zero), base, 8).config
    state_config = stage_costs.state_config(config)
    state, measured = stage_costs.state_pieces(config), stage_costs._measured_state_pieces(state_config)
    for name in ("block", "first", "last"):  # the step's transient is `step_transient`'s, below
        assert _without_step(getattr(state, name)) == _without_step(getattr(measured, name)), name
    interpolated = stage_costs.step_transient(config, 3)
    assert interpolated.at(3) == pytest.approx(stage_costs._measure_step_transient(state_config, 3).at(3), rel=0.05)


def test_expert_parallel_microbatch_costs_are_interpolated_in_one_over_ep():
    """A microbatch's costs at ep8 from probes at ep2 and ep4 (the dispatch's bookkeeping and the local experts'
    work) equal a probe at ep8, deepseek_v3 debugmodel at dp8: every number within 1e-9 relative, the collectives
    the same; fewer local experts than at ep2 do less work."""
    config = check(Layout(dp=8, tp=1, pp=1, ep=8), _job(*DSV3_DEBUG, "--training.global_batch_size", "16"), 8).config
    interpolated = microbatch_pieces(config, 1)
    _same_microbatch_costs(interpolated, stage_costs._probed_microbatch_pieces(config, 1))
    at_ep2 = stage_costs._probed_microbatch_pieces(stage_costs._with_degree(config, "ep", 2), 1)
    assert interpolated.block.backward.other_bytes < at_ep2.block.backward.other_bytes  # fewer local experts


def _same_microbatch_costs(got: stage_costs.Pieces, want: stage_costs.Pieces) -> None:
    """Every number of two `MicrobatchCost` pieces within 1e-9 relative (float rounding of an interpolation), their
    ops and collectives the same."""
    for name in ("block", "first", "last"):
        a, b = getattr(got, name), getattr(want, name)
        for field in ("saved_bytes", "transient_bytes", "received_bytes", "held_output_bytes"):
            assert getattr(a, field) == pytest.approx(getattr(b, field), rel=1e-9, abs=1e-6), (name, field)
        for g, w in ((a.forward, b.forward), (a.backward, b.backward)):
            assert (g.flops, g.other_bytes) == pytest.approx((w.flops, w.other_bytes), rel=1e-9, abs=1e-6), name
            assert g.ops == w.ops and [(c.op, c.dim) for c in g.collectives] == [(c.op, c.dim) for c in w.collectives]
            assert [c.bytes for c in g.collectives] == pytest.approx([c.bytes for c in w.collectives], rel=1e-9)


def test_context_parallel_costs_are_interpolated_in_one_over_cp_exactly(monkeypatch):
    """Microbatch costs at cp8 from probes at cp2 and cp4 (every tensor is affine in 1 / cp: a rank's share of each
    sequence, or the whole gathered keys and values) equal a probe at cp8, debug model at 256 tokens, no activation
    checkpointing: every number within 1e-9, the transients included. The transient is a peak, and its moment
    moves here (the first stage's, 1.24 MB at cp8, falls elsewhere than at cp2 and cp4): interpolated as a number
    it would be 29% short; the probes' live-bytes traces interpolated entry by entry give it exactly. And cp8 is
    not probed: probes whose traces differ in length do not interpolate, and the planner then probes every degree
    (a view op's outputs, as many as `chunk(cp)` makes, once added entries: issue 57's 405B probed 12 degrees)."""
    base = _job("--model.flavor", "debugmodel", "--training.seq_len", "256", "--training.global_batch_size", "8")
    config = check(Layout(dp=1, tp=1, pp=1, cp=8), base, 8).config
    monkeypatch.setattr(stage_costs, "_CACHE", {})
    probe, probed_degrees = stage_costs._microbatch, set()

    def counted(config, world: int, rank: int) -> stage_costs.MicrobatchCost:
        probed_degrees.add(config.parallelism.context_parallel_degree)
        return probe(config, world, rank)

    monkeypatch.setattr(stage_costs, "_microbatch", counted)
    interpolated = microbatch_pieces(config, 1)
    assert probed_degrees == {2, 4}
    probed = stage_costs._probed_microbatch_pieces(config, 1)
    _same_microbatch_costs(interpolated, probed)
    low, high = (stage_costs._probed_microbatch_pieces(stage_costs._with_degree(config, "cp", cp), 1) for cp in (2, 4))
    as_numbers = low.first.transient_bytes + (1 / 8 - 1 / 2) / (1 / 4 - 1 / 2) * (
        high.first.transient_bytes - low.first.transient_bytes)  # fmt: skip
    assert as_numbers == pytest.approx(0.714 * probed.first.transient_bytes, rel=0.01)


def test_microbatch_costs_beyond_two_sequences_are_the_probes():
    """Costs of 4 sequences per microbatch from probes of 1 and 2 (affine in the microbatch size) equal a probe
    of 4, debug model at pp2 x cp2 with full activation checkpointing: every number within 1e-9, the transients
    too (interpolated as numbers, the first stage's would be short by a third: the dry run found the old
    prediction's activations of this layout's mb8 GPipe variant 36% short on its first stage)."""
    base = _job("--model.flavor", "debugmodel", "--training.seq_len", "64", "--training.global_batch_size", "8")
    config = check(Layout(dp=1, tp=1, pp=2, cp=2, activation_checkpoint="full", microbatch_size=4,
                          schedule="1F1B"), base, 4).config  # fmt: skip
    probed = stage_costs._probed_microbatch_pieces(config, 4)
    _same_microbatch_costs(microbatch_costs(config, 4), probed)


def test_cp_layouts_share_the_state_of_dp_x_cp_ranks():
    """The state pieces and the optimizer step's transient of dp2 x cp2 measured as built (cp2) equal those of the
    four dp ranks cp folds into (what the planner measures), at every ZeRO stage, to the byte: ZeRO and FSDP shard
    over dp x cp ranks, and cp holds no state of its own."""
    base = _job("--model.flavor", "debugmodel", "--training.seq_len", "64", "--training.global_batch_size", "8")
    for zero in (0, 1, 2, 3):
        config = check(Layout(dp=2, tp=1, pp=1, cp=2, zero_stage=zero), base, 4).config
        as_built = stage_costs.two_stage_config(config)
        as_built.activation_checkpoint.mode = "none"
        assert as_built.parallelism.context_parallel_degree == 2
        assert stage_costs._measured_state_pieces(as_built) == stage_costs.state_pieces(config), zero
        built, folded = stage_costs._measure_step_transient(as_built, 6), stage_costs.step_transient(config, 6)
        assert built == folded, zero


def test_zero0_state_is_the_same_at_every_data_parallel_degree_above_one():
    """Under ZeRO-0 every dp rank holds the whole state (and all-reduces whole buckets): the state pieces and the
    optimizer step's transient measured at dp8 equal those of dp2, which the planner measures for every dp > 1."""
    base = _job("--model.flavor", "debugmodel", "--training.seq_len", "64", "--training.global_batch_size", "8")
    config = check(Layout(dp=8, tp=1, pp=1, zero_stage=0), base, 8).config
    as_built = stage_costs.two_stage_config(config)
    as_built.activation_checkpoint.mode = "none"
    assert stage_costs.state_config(config).parallelism.data_parallel_degree == 2
    assert stage_costs._measured_state_pieces(as_built) == stage_costs.state_pieces(config)
    assert stage_costs._measure_step_transient(as_built, 6) == stage_costs.step_transient(config, 6)


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(("--model.flavor", "debugmodel", "--training.seq_len", "64"), id="llama3"),
        pytest.param(DSV3_DEBUG, id="deepseek_v3"),
    ],
)
def test_a_search_tells_its_measurements_apart_by_their_keys(argv):
    """A search looks each piece up by the few layout fields it depends on (`Measured`), not by each layout's
    whole config: over every layout of a search with cp (and ep for the MoE family) on 8 GPUs, layouts with the
    same key are measured on the same config (`state_config`, `microbatch_config`)."""
    base = _job(*argv, "--training.global_batch_size", "8")
    checked = [c for cp in (False, True) for c in valid_layouts(base, 8, 8, context_parallel=cp)[0]]
    assert {c.layout.cp for c in checked} == {1, 2, 4, 8}
    assert {c.layout.ep for c in checked} == ({1, 2, 4, 8} if argv == DSV3_DEBUG else {1})
    for key, config in ((state_key, lambda c: stage_costs.state_config(c.config)),
                        (microbatch_key, lambda c: stage_costs.microbatch_config(c.config, c.layout.microbatch_size))):
        configs = {}
        for c in checked:
            configs.setdefault(key(c.layout), set()).add(to_toml(config(c)))
        assert len(configs) > 20 and all(len(found) == 1 for found in configs.values()), key.__name__


_SEARCH_IN_A_NEW_PROCESS = """
import json, sys
from torchpre.config.job_config import JobConfig
from torchpre.config.parser import parse_args
from torchpre.planner.hardware import get_hardware
from torchpre.planner import layout_space, search
layout_space.ZERO_STAGES, layout_space.AC_MODES, layout_space.MICROBATCH_SIZES = (1, 3), ("none",), (1,)
layout_space.TRY_WHOLE_SHARE = False
search.needs_context_parallel = lambda predictions: True
base = parse_args(JobConfig, "--model.flavor tiny --training.seq_len 32 --training.global_batch_size 8".split())
result = search.search(base, get_hardware("h100-80gb"), 2, workers=int(sys.argv[1]))
print(json.dumps([p.as_dict() for p in result.predictions]))
"""


def test_two_worker_processes_predict_what_one_process_does():
    """`search(..., workers=2)` deals the layouts out by tp to two forked processes: the same predictions, in the
    same order, as one process, with cp searched (its second phase reuses what the first phase's workers measured).
    Tiny model on 2 GPUs, narrowed; each search in a new process, as a user's runs: a process that has run autograd
    (as this test session has) cannot fork workers that run it."""
    runs = [subprocess.run([sys.executable, "-c", _SEARCH_IN_A_NEW_PROCESS, n], capture_output=True, text=True,
                           timeout=140, check=True) for n in ("1", "2")]  # fmt: skip
    one, two = (json.loads(run.stdout) for run in runs)
    assert {(layout["tp"], layout["cp"]) for layout in two} == {(1, 1), (1, 2), (2, 1)}
    assert two == one


def test_the_microbatch_probe_counts_what_the_dry_run_counts():
    """The planner probes a microbatch without building the rank's optimizer state or running its step
    (`probe_rank_parts`); the dry run's `probe_rank` runs them first. Both count the same, on one rank (a plain
    model whose gradients stay in its parameters) and under tp2 x cp2."""
    base = _job("--model.flavor", "debugmodel", "--training.seq_len", "64", "--training.global_batch_size", "8")
    for tp, cp in ((1, 1), (2, 2)):
        config = check(Layout(dp=1, tp=tp, pp=2, cp=cp, schedule="1F1B"), base, 2 * tp * cp).config
        for rank in (0, tp * cp):
            _, parts = build_and_probe(config, 2 * tp * cp, rank, checkpoint=False, data=False)
            assert probe_rank_parts(config, 2 * tp * cp, rank) == parts, (tp, cp, rank)


def _narrow(monkeypatch, tp: tuple[int, ...] = (1,), pp: tuple[int, ...] = (1,), **values) -> None:
    """The search cut to the given degrees and `values` (ZERO_STAGES=..., AC_MODES=...) to keep its probes few."""
    for name, value in values.items():
        monkeypatch.setattr(layout_space, name, value)
    every = layout_space.candidates
    monkeypatch.setattr(layout_space, "candidates", lambda *args, **kwargs: (
        layout for layout in every(*args, **kwargs) if layout.tp in tp and layout.pp in pp))  # fmt: skip


def test_deepseek_v3_lite_on_8_h100s_fits_only_with_its_experts_split(monkeypatch):
    """deepseek_v3 lite (16.0B parameters, 14.4B of them in 26 layers of 64 routed experts) on 8 H100s at ZeRO-1, dp8,
    full activation checkpointing, one sequence of 4,096 tokens per microbatch. Replicated experts need their bf16
    parameters and fp32 gradients whole on every rank: ep1's model state alone needs 107.2 GiB of tensors, 125.5 GiB
    of the allocator's 78.6, ep2 82.2 GiB in all (70.3 of tensors: the allocator's peak is what fits), ep8 47.0;
    each rank's parameter bytes fall as ep splits the experts, and its optimizer
    state does not move (ZeRO-1 shards the experts' over the edp = dp / ep ranks that hold them: 1 / dp of them
    whatever ep). The search is cut to these four layouts (its probes take most of the time)."""
    _narrow(monkeypatch, ZERO_STAGES=(1,), AC_MODES=("full",), MICROBATCH_SIZES=(1,), TRY_WHOLE_SHARE=False)
    monkeypatch.setattr(search_module, "needs_context_parallel", lambda predictions: False)
    base = _job("--model.name", "deepseek_v3", "--model.flavor", "lite", "--training.seq_len", "4096",
                "--training.global_batch_size", "64", "--training.mixed_precision_param", "bfloat16")  # fmt: skip
    result = search(base, get_hardware("h100-80gb"), 8)
    by_ep = {p.checked.layout.ep: p for p in result.predictions}
    assert sorted(by_ep) == [1, 2, 4, 8]
    assert by_ep[1].step is None and not by_ep[1].fits  # the model state alone does not fit
    assert [p.checked.layout.ep for p in result.fitting] == [4, 8], result.table(4)
    params = [by_ep[ep].peak.param_bytes for ep in sorted(by_ep)]
    assert params == sorted(params, reverse=True) and len(set(params)) == 4
    assert len({by_ep[ep].peak.optimizer_state_bytes for ep in by_ep}) == 1
    assert all(by_ep[ep].step.ep_comm_s > 0 for ep in (2, 4, 8))


def test_expert_gradients_are_reduced_over_the_ranks_that_hold_the_same_experts():
    """The step-time model's DP term under expert parallelism, by hand: ZeRO-1 at dp4 x ep2 reduce-scatters the
    dense gradients over the 4 dp ranks and the experts' over the 2 edp ranks that hold the same experts (each rank
    holds half of them), then all-gathers the parameters over the same groups; fp32, within a node."""
    base = _job(*DSV3_DEBUG, "--training.global_batch_size", "8")
    checked = check(Layout(dp=4, tp=1, pp=1, ep=2, zero_stage=1, microbatch_size=2), base, 4)
    model = meta_model(checked.config, get_model_spec("deepseek_v3"), checked.model_args)
    numel = {name: p.numel() for name, p in model.named_parameters()}
    experts = sum(n for name, n in numel.items() if ".experts." in name)
    dense_bytes, expert_bytes = 4 * (sum(numel.values()) - experts), 4 * experts // 2
    hardware = get_hardware("h100-80gb")
    step = predict(checked, hardware, 4, model_flops_per_token(checked.config, checked.model_args)).step

    def gradients_and_parameters(ranks: int, nbytes: int) -> float:
        return sum(collective_seconds(op, ranks, nbytes, hardware.intra_node_bw, hardware)
                   for op in ("reduce_scatter", "all_gather"))  # fmt: skip

    assert experts > 0
    expected = gradients_and_parameters(4, dense_bytes) + gradients_and_parameters(2, expert_bytes)
    assert step.dp_comm_s == pytest.approx(expected, rel=1e-9)


@pytest.mark.plan_matrix
@pytest.mark.timeout(1800)
def test_deepseek_v3_lite_on_64_h100s_is_offered_expert_parallel_layouts():
    """The whole search for deepseek_v3 lite on 64 H100s at 4,096 tokens, 256 sequences per step: the fastest
    fitting layout splits the experts (ep > 1), and every expert-parallel degree that divides dp is offered. `-s`
    prints the table docs/planning.md shows."""
    base = _job("--model.name", "deepseek_v3", "--model.flavor", "lite", "--training.seq_len", "4096",
                "--training.global_batch_size", "256", "--training.mixed_precision_param", "bfloat16")  # fmt: skip
    result = search(base, get_hardware("h100-80gb"), 64)
    print(result.table(8))
    assert result.fitting[0].checked.layout.ep > 1, result.table(8)
    assert {p.checked.layout.ep for p in result.predictions} == {1, 2, 4, 8, 16, 32, 64}


@pytest.mark.plan_matrix
def test_deepseek_v3_671B_on_2048_h100s_at_its_pretraining_shape(monkeypatch):
    """DeepSeek-V3 671B with its MTP module on 2,048 H100s, 2,048 sequences of 4,096 tokens per step, the search cut
    to DeepSeek-V3's own choices but ep (no tensor parallelism, ZeRO-1, full activation checkpointing, one sequence
    per microbatch, 1F1B) over 8 or 16 pipeline stages: the whole search (37,968 candidates over 936 sharding
    configurations, each built three times) does not run here in useful time. The planner offers only
    expert-parallel layouts: without ep the experts alone do not fit. `-s` prints the table docs/deepseek-v3.md
    shows."""
    _narrow(monkeypatch, tp=(1,), pp=(8, 16), ZERO_STAGES=(1,), AC_MODES=("full",), MICROBATCH_SIZES=(1,),
            PLANNED_SCHEDULES=(("1F1B", 1),))  # fmt: skip
    monkeypatch.setattr(search_module, "needs_context_parallel", lambda predictions: False)
    result = search(_job(*DSV3_671B), get_hardware("h100-80gb"), 2048)
    print(result.table(8))
    assert result.fitting and all(p.checked.layout.ep > 1 for p in result.fitting), result.table(8)
    deepseek = next(p for p in result.predictions if (p.checked.layout.pp, p.checked.layout.ep) == (16, 64))
    assert deepseek.fits and deepseek.peak.total_bytes == pytest.approx(50.89 * 2**30, rel=1e-3)


def test_a_first_stage_without_the_dense_blocks_is_refused_by_name():
    """671B's 3 dense first blocks are costed with the first stage's ends: over 32 stages its first holds 2 of the
    61 blocks, and the planner refuses the layout saying why; over 16 (4 blocks) it accepts it."""
    base = _job(*DSV3_671B)
    with pytest.raises(ConfigError, match="first pipeline stage holds 2 blocks, fewer than the model's first_k_dense"):
        layout_space._dense_blocks_first(check(Layout(dp=64, tp=1, pp=32, ep=64, schedule="1F1B"), base, 2048))
    accepted = check(Layout(dp=128, tp=1, pp=16, ep=64, schedule="1F1B"), base, 2048)
    assert layout_space._dense_blocks_first(accepted) is accepted


def test_the_planner_prices_meta_s_405b_split_with_the_embedding_and_the_output_alone():
    """The Llama 3 paper's 8,192-GPU row at 8 virtual stages with the embedding and the output counted as a layer each
    (`--fixed`): 128 one-unit stages, the first rank's chunks the embedding alone and 7 blocks, the last rank's 7
    blocks and the output alone, every other rank's 8 blocks. Without the counts 126 blocks cannot fill 128 stages."""
    from bench.published_runs import LLAMA3_ROWS
    from torchpre.planner.given_layout import check_fixed
    from torchpre.planner.stage_costs import stage_shape

    argv = [*LLAMA3_ROWS[0].argv(), "--parallelism.pipeline_parallel_virtual_stages", "8"]
    without = ["--parallelism.pipeline_parallel_embedding_layers", "0",
               "--parallelism.pipeline_parallel_output_layers", "0"]  # fmt: skip
    with pytest.raises(ConfigError, match="126 layers, fewer than the 128 pipeline stages"):
        check_fixed(_job(*argv, *without), 8192)
    assert "--parallelism.pipeline_parallel_embedding_layers" in argv  # the row's own keys count the ends
    checked = check_fixed(_job(*argv), 8192)
    assert stage_shape(checked, 0) == [(0, True, False), *[(1, False, False)] * 7]
    assert stage_shape(checked, 15) == [*[(1, False, False)] * 7, (0, False, True)]
    assert all(stage_shape(checked, rank) == [(1, False, False)] * 8 for rank in range(1, 15))


def test_the_planner_prices_stages_holding_the_embedding_or_the_output_alone_as_the_dry_run():
    """8B cut to 30 blocks at 64 ranks, pp4 x 8 interleaved stages with the embedding and the output counted as a layer
    each: stage 0 holds the embedding alone and stage 31 the output alone. The pieces extended to a stage of no
    blocks (the first stage's ends less a block) against a full dry run of each pipeline rank: equal to the byte,
    activations included (measured: every rank's, 1.55 to 1.78 GB)."""
    layout = Layout(dp=2, tp=8, pp=4, zero_stage=3, activation_checkpoint="selective", schedule="Interleaved1F1B",
                    virtual_stages=8)  # fmt: skip
    base = _job("--model.flavor", "8B", "--model.n_layers", "30", "--training.seq_len", "2048",
                "--training.global_batch_size", "64", "--training.mixed_precision_param", "bfloat16",
                "--parallelism.pipeline_parallel_embedding_layers", "1",
                "--parallelism.pipeline_parallel_output_layers", "1")  # fmt: skip
    checked = check(layout, base, 64)
    assert checked.pipeline.stage_modules[0] == ["tok_embeddings"]
    assert checked.pipeline.stage_modules[-1] == ["norm", "output"]
    prediction = predict(checked, get_hardware("h100-80gb"), 64, model_flops_per_token(checked.config,
                                                                                        checked.model_args))
    for pp_rank, rank in enumerate(prediction.ranks):
        real = build_rank(checked.config, 64, pp_rank * layout.dp * layout.tp, checkpoint=False)
        assert (rank.param_bytes, rank.grad_bytes, rank.optimizer_state_bytes) == (
            real.param_bytes, real.grad_bytes, real.optimizer_state_bytes)  # fmt: skip
        assert rank.activation_bytes == real.activation_bytes, pp_rank
