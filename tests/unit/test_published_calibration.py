"""The planner against published training runs (issues 53 and 61), recomputed from the planner on every run: a later
change to the time or memory model that moves a row away from what it predicts today fails here instead of silently
changing the calibration (bench/plan_vs_published.py prints the same tables).

CI predicts torchtitan's rows and a seeded sample of the corpus (a row of each source, `SAMPLE`); with
`-m published_corpus` every row of bench/published_runs.py, each pinned, and the summary docs/planning.md prints.
"""

import dataclasses
import itertools
import random
import statistics

import pytest

from bench.plan_vs_published import HELD_OUT, ROWS, compare, compare_all, fit, main, selected
from bench.published_runs import (
    BRIDGE,
    CALIBRATION,
    CORPUS,
    EVALUATION,
    LLAMA3,
    LLAMA3_ROWS,
    MEGATRON_1,
    MEGATRON_2,
    MEGATRON_T1,
    MOSAIC_A100,
    MOSAIC_H100,
    NEMO,
    TARGET,
    TORCHTITAN,
    megatron_tokens,
)
from tests.unit.published_pins import CORPUS_PINNED, NOT_FITTING, SUMMARY
from torchpre.config.job_config import JobConfig
from torchpre.config.parser import parse_args
from torchpre.planner import layout_space
from torchpre.planner import search as search_module
from torchpre.planner.allocator import FRAGMENTATION
from torchpre.planner.cost_cache import Measured
from torchpre.planner.hardware import get_hardware
from torchpre.planner.predict import ERROR_BARS
from torchpre.planner.search import search

pytest.importorskip("torchao")  # the Float8 rows' linears

# The errors the model gives today (docs/planning.md#checked-against-published-runs), pinned: a change that moves a
# row's TPS error by more than 3 points, or its memory error by more than 2, must say so here and in the docs.
PINNED_TPS_ERROR = (-0.036, 0.025, -0.023, -0.070, -0.154, 0.111, 0.147, -0.006, 0.054, 0.001)
PINNED_MEMORY_ERROR = (0.007, 0.008, 0.011, 0.004, 0.000, 0.003, -0.003, -0.006, -0.013, -0.010)


def test_every_row_names_its_source_and_only_the_issues_sources_calibrate():
    """Every row cites a title, where it is published and its table, and the calibration rows are Megatron-LM 2021's
    Tables 1 and 2, MosaicML's H100 BF16 table and torchtitan's 8B rows, none else."""
    assert {row.source for row in CALIBRATION} == {MEGATRON_1, MEGATRON_2, MOSAIC_H100, TORCHTITAN}
    assert not any(row.source.calibration for row in EVALUATION)
    assert (len(MEGATRON_T1), len([r for r in CORPUS if r.source is MEGATRON_2])) == (10, 12)
    assert len([r for r in CORPUS if r.source is MOSAIC_H100]) == 52  # every row of the README's table
    for row in CORPUS:
        assert row.source.title and row.source.where and row.source.table and row.row and row.published
    assert len({row.name for row in CORPUS}) == len(CORPUS)
    assert {NEMO.hardware, BRIDGE.hardware, LLAMA3.hardware} == {"h100-80gb"}


def test_only_the_runs_torchpre_cannot_express_are_left_out_of_the_target_and_each_says_why():
    """Megatron-Core's FP8 runs (NeMo 24.07, Megatron-Bridge 25.11: TransformerEngine's FP8 layers) are outside issue
    61's targets, with the reason stated; every other evaluation row counts, and no calibration row is left out."""
    assert {row.source for row in CORPUS if row.source.outside_target} == {NEMO, BRIDGE}
    assert all("TransformerEngine" in source.outside_target for source in (NEMO, BRIDGE))
    assert TARGET == tuple(row for row in EVALUATION if row.source not in (NEMO, BRIDGE))
    assert len(TARGET) == len(EVALUATION) - 8


def test_rows_are_chosen_by_a_part_of_their_name():
    """`--rows TEXT` keeps the rows whose name contains TEXT; text that names none is a usage error (exit 2)."""
    assert {row.source for row in selected(CORPUS, "mosaic a100")} == {MOSAIC_A100}
    assert len(selected(CORPUS, "mosaic a100")) == 61 and selected(CORPUS, "") == list(CORPUS)
    with pytest.raises(SystemExit) as exited:
        main(["--all", "--rows", "no such run"])
    assert exited.value.code == 2


def test_the_a100_attends_at_the_flash_attention_benchmarks_rate_not_its_matmul_rate():
    """No calibration row runs flash attention on an A100, so its attention rate comes from a kernel benchmark (the
    FlashAttention-2 paper: FlashAttention reaches 25-40% of the A100's peak; the row takes 0.325), not from its
    matmul rate (0.61). MosaicML's 350m at 65,536 tokens on 8 A100s, four fifths of whose FLOPs are attention, was
    predicted 82% fast at the matmul rate; it is within 10%."""
    (row,) = [r for r in CORPUS if r.source is MOSAIC_A100 and r.model.label == "mpt-350m" and r.seq_len == 65536]
    assert abs(compare(row).tps_error) < 0.10


def test_published_throughput_is_converted_as_each_source_counts_it():
    """Megatron-LM 2021 publishes teraFLOP/s per GPU by its equation (3), recomputation included: 1T (h 25600, 128
    layers) at 163 is 163e12 / (96 x 128 x 25600^2 x (1 + 2048 / 153600 + 51200 / 52428800)) = 19.96 tokens/s. The
    Llama 3 paper publishes TFLOPs per GPU: 430 at 2.6254e12 model FLOPs per token of 405B at 8K is 163.8."""
    assert megatron_tokens(163, 25600, 128) == pytest.approx(19.96, abs=0.01)
    assert MEGATRON_T1[-1].tokens_per_s_per_gpu == pytest.approx(19.96, abs=0.01)
    assert LLAMA3_ROWS[0].tokens_per_s_per_gpu == pytest.approx(163.8, abs=0.1)
    assert MEGATRON_T1[0].tokens_per_s_per_gpu == pytest.approx(9288, abs=1)  # 1.7B at 137 TFLOP/s


def test_a_fit_moves_an_efficiency_to_the_grid_value_its_rows_fit_best():
    """`fit` on torchtitan's first three 8B rows (table 1), from a matmul rate of 0.30, lands on 0.62, the grid value
    that minimises their absolute log errors (all ten rows, whose attention-heavy long-context rows pull it down, fit
    0.58: the row's value): the coordinate search moves to the best of the grid, not to where it started."""
    hardware = dataclasses.replace(get_hardware(TORCHTITAN.hardware), matmul_efficiency=0.30)
    assert fit(ROWS[:3], hardware, ("matmul_efficiency",)) == {"matmul_efficiency": 0.62}


@pytest.fixture(scope="module")
def compared():
    return compare_all(ROWS)


def test_every_row_is_within_its_band(compared):
    """Reserved memory within ±10% and TPS/GPU within ±20% of what torchtitan published, on every row."""
    outside = [(c.row.name, f"memory {c.memory_error:+.1%}", f"TPS {c.tps_error:+.1%}") for c in compared
               if abs(c.memory_error) > ERROR_BARS["memory_gib"]
               or abs(c.tps_error) > ERROR_BARS["tokens_per_s_per_gpu"]]  # fmt: skip
    assert not outside


def test_the_errors_are_the_documented_ones(compared):
    assert [c.tps_error for c in compared] == pytest.approx(PINNED_TPS_ERROR, abs=0.03)
    assert [c.memory_error for c in compared] == pytest.approx(PINNED_MEMORY_ERROR, abs=0.02)


def test_rows_further_apart_than_the_error_come_out_in_the_published_order(compared):
    """Where two published TPS/GPU differ by more than the stated error (20%), the predictions rank them the same."""
    for a, b in itertools.combinations(compared, 2):
        if max(a.row.tokens_per_s_per_gpu, b.row.tokens_per_s_per_gpu) > 1.2 * min(a.row.tokens_per_s_per_gpu,
                                                                                 b.row.tokens_per_s_per_gpu):
            assert (a.row.tokens_per_s_per_gpu > b.row.tokens_per_s_per_gpu) == (a.tps_per_gpu > b.tps_per_gpu), (
                a.row.name, b.row.name)  # fmt: skip


def test_the_tensor_peak_is_below_the_reserved_one(compared):
    """The dry run counts tensors; the allocator reserves more (docs: the gap, modelled explicitly)."""
    for c in compared:
        assert c.tensor_gib < c.reserved_gib < 1.2 * c.tensor_gib


# torchtitan's 70B and 405B rows (tables 4-6), which nothing in the model was fitted to: today's errors, pinned as the
# 8B rows' are. Before the unsharded gradients of ZeRO-3 under pipelining were counted, every 405B row's memory was
# 19-35% low; the interleaved row was 14.0% over while the planner held the largest chunk's bytes (on the last rank,
# the output layer's) for every microbatch in flight (docs/planning.md#rows-the-model-was-not-fitted-on).
HELD_OUT_TPS_ERROR = (-0.132, -0.087, 0.068, -0.117, 0.034, 0.012, 0.147)
HELD_OUT_MEMORY_ERROR = (-0.043, -0.040, 0.024, 0.086, 0.080, 0.063, -0.033)


@pytest.fixture(scope="module")
def held_out():
    return compare_all(HELD_OUT)


def test_the_rows_nothing_was_fitted_to_are_within_the_bands(held_out):
    """70B at FSDP 32 x TP 8, 405B at FSDP x TP 8 x PP 8 under 1F1B and Interleaved 1F1B, with cp 1-8: TPS/GPU
    within ±20% and memory within ±10% on every row."""
    assert all(abs(c.tps_error) <= ERROR_BARS["tokens_per_s_per_gpu"] for c in held_out), held_out
    assert all(abs(c.memory_error) <= ERROR_BARS["memory_gib"] for c in held_out), held_out


def test_the_held_out_errors_are_the_documented_ones(held_out):
    assert [c.tps_error for c in held_out] == pytest.approx(HELD_OUT_TPS_ERROR, abs=0.03)
    assert [c.memory_error for c in held_out] == pytest.approx(HELD_OUT_MEMORY_ERROR, abs=0.02)


def _sample() -> list:
    """One row of every source, drawn with a fixed seed: every source's mapping runs in CI, the whole corpus under
    `-m published_corpus`."""
    rng = random.Random(61)
    return [rng.choice([row for row in CORPUS if row.source is source])
            for source in dict.fromkeys(row.source for row in CORPUS)]  # fmt: skip


SAMPLE = _sample()


@pytest.mark.parametrize("row", SAMPLE, ids=[row.name for row in SAMPLE])
def test_a_sample_of_the_corpus_is_predicted_as_pinned(row):
    """TPS/GPU error within 3 points of the pinned one, and whether it fits as pinned."""
    c = compare(row)
    assert (c.tps_error, c.fits) == (pytest.approx(CORPUS_PINNED[row.name][0], abs=0.03), CORPUS_PINNED[row.name][1])


@pytest.fixture(scope="module")
def corpus():
    return compare_all(CORPUS)


# The whole corpus is predicted once per module (3.6 CPU minutes; 17.6 minutes of wall time on a loaded 2-core machine).
@pytest.mark.published_corpus
@pytest.mark.timeout(3600)
def test_every_row_of_the_corpus_is_predicted_as_pinned(corpus):
    moved = [(c.run.name, f"{c.tps_error:+.3f}", c.fits) for c in corpus
             if abs(c.tps_error - CORPUS_PINNED[c.run.name][0]) > 0.03 or c.fits != CORPUS_PINNED[c.run.name][1]]
    assert not moved
    assert {c.run.name for c in corpus if not c.fits} == NOT_FITTING


@pytest.mark.published_corpus
@pytest.mark.timeout(3600)
def test_the_corpus_summary_is_the_documented_one(corpus):
    """The medians and worst errors docs/planning.md prints: calibration rows, evaluation-only rows, and the
    evaluation rows issue 61's targets count."""
    sets = {"calibration": CALIBRATION, "evaluation": EVALUATION, "target": TARGET}
    for name, rows in sets.items():
        chosen = [c for c in corpus if c.run in rows]
        errors = [c.tps_error for c in chosen]
        median, worst, fit = SUMMARY[name]
        assert statistics.median(abs(e) for e in errors) == pytest.approx(median, abs=0.005)
        assert max(errors, key=abs) == pytest.approx(worst, abs=0.01)
        assert sum(c.fits for c in chosen) == fit


def _search_offers_the_published_layout_or_a_faster_one(row, monkeypatch, keep, **space) -> bool:
    """Whether a search of the row's job (its model, batch, precision and kernels), over the layouts `keep` accepts
    and the ZeRO stages, AC modes and microbatch sizes `space` sets (to keep its probes few), lists among its ten
    fastest fitting layouts the published one or one predicted faster that fits."""
    for name, value in space.items():
        monkeypatch.setattr(layout_space, name, value)
    every = layout_space.candidates
    monkeypatch.setattr(layout_space, "candidates", lambda *args, **kwargs: (
        layout for layout in every(*args, **kwargs) if keep(layout)))  # fmt: skip
    monkeypatch.setattr(search_module, "needs_context_parallel", lambda predictions: False)
    result = search(parse_args(JobConfig, row.argv()), get_hardware(row.source.hardware), row.gpus)
    published = compare(row).prediction
    top = result.fitting[:10]
    offered = published.checked.layout in [p.checked.layout for p in top]
    return bool(top) and (offered or top[0].tokens_per_sec > published.tokens_per_sec)


def test_a_search_for_a_published_job_offers_its_layout_or_a_faster_one_that_fits(monkeypatch):
    """MosaicML's 13B at 2,048 tokens on 8 H100s, 16 sequences per step (FSDP over 8, no checkpointing, 2 sequences
    per microbatch), searched over tp 1-2 without pipelining, ZeRO 1 and 3, no or full checkpointing, 1 or 2
    sequences per microbatch: its own layout is among the ten fastest that fit."""
    (row,) = [r for r in CORPUS if r.source is MOSAIC_H100 and r.model.label == "mpt-13b" and r.seq_len == 2048
              and r.gpus == 8]  # fmt: skip
    assert compare(row).fits
    assert _search_offers_the_published_layout_or_a_faster_one(
        row, monkeypatch, lambda layout: layout.tp <= 2 and layout.pp == 1, ZERO_STAGES=(1, 3),
        AC_MODES=("none", "full"), MICROBATCH_SIZES=(1, 2))  # fmt: skip


def test_a_search_for_torchtitans_70b_offers_its_one_microbatch_layout(monkeypatch):
    """torchtitan's 70B on 256 H100s (FSDP 32 x TP 8, 16 sequences per rank in one microbatch, full checkpointing,
    compile, Float8), searched over tp8 without pipelining, ZeRO-3, full checkpointing and 4 or 8 sequences per
    microbatch: the search also tries each rank's whole share in one microbatch (`microbatch_sizes`), and the published
    layout is among the ten fastest that fit (without that candidate the best offered, mb8, was predicted 0.7% slower
    and the published one was never tried)."""
    (row,) = [r for r in HELD_OUT if r.model.label == "llama3.1-70B"]
    assert layout_space.microbatch_sizes(row.global_batch, row.dp, 1) == (*layout_space.MICROBATCH_SIZES, 16)
    assert _search_offers_the_published_layout_or_a_faster_one(
        row, monkeypatch, lambda layout: layout.tp == 8 and layout.pp == 1, ZERO_STAGES=(3,), AC_MODES=("full",),
        MICROBATCH_SIZES=(4, 8))  # fmt: skip


@pytest.mark.parametrize("label", ["gpt-39.1B", "gpt-76.1B"])
def test_a_search_for_a_pipelined_published_job_offers_its_layout_or_a_faster_one(label, monkeypatch):
    """Megatron-LM 2021's 39.1B on 512 A100s (tp8 x pp2, 1F1B, 4 sequences per microbatch) and 76.1B on 1,024
    (tp8 x pp4, Interleaved 1F1B v3, 2 per microbatch), searched over tp8 with pp up to 4 and 8, ZeRO 0 and 1, full
    checkpointing, the published microbatch and the one below it: the published layout or one predicted faster
    that fits is among the ten fastest that fit (76.1B's v3 is not a searched schedule: a faster one is)."""
    (row,) = [r for r in MEGATRON_T1 if r.model.label == label]
    microbatches = (row.microbatch // 2, row.microbatch)
    assert _search_offers_the_published_layout_or_a_faster_one(
        row, monkeypatch, lambda layout: layout.tp == 8 and layout.pp <= 2 * row.pp, ZERO_STAGES=(0, 1),
        AC_MODES=("full",), MICROBATCH_SIZES=microbatches)  # fmt: skip


def test_a_knob_the_source_does_not_state_is_the_planners_choice():
    """Megatron-LM 2021 does not state Table 2's pipeline schedule: its 175B PTD-P row on 384 A100s (tp8 x pp12, 96
    layers) is predicted at every legal one, 1F1B and Interleaved 1F1B at 2 to 8 stages per rank, and the fastest
    that fits is kept (one rule for every row with an unstated knob, `Run.unstated`, not a value per row)."""
    (row,) = [r for r in CORPUS if r.source is MEGATRON_2 and r.tp == 8 and r.pp == 12 and r.gpus == 384]
    choices = row.choices(96)
    assert [(c.schedule, c.virtual_stages) for c in choices] == [("1F1B", 1)] + [
        ("Interleaved1F1B", v) for v in range(2, 9)]
    every = [compare(dataclasses.replace(choice, unstated=())) for choice in choices]
    settled = compare(row)
    assert settled.run is row and settled.tps_per_gpu == max(c.tps_per_gpu for c in every if c.fits)
    (llama3,) = [r for r in LLAMA3_ROWS if r.gpus == 8192]
    assert len(llama3.choices(128)) == 7 * 6  # 2 to 8 stages per rank (126 blocks + embedding + output); 32 = 2^5


def test_the_llama3_papers_layout_does_not_fit_torchpres_blocks():
    """Meta trained 405B on 80 GB H100s at tp8 x pp16 without activation checkpointing, its first and last stages one
    layer short. At the row's keys (that split: parallelism.pipeline_parallel_embedding_layers and _output_layers 1;
    parallelism.sequence_parallel_save_shard; activation_checkpoint.recompute_mlp_activation) torchpre's block saves
    0.395 GiB per microbatch, and torch's Interleaved 1F1B at 8 stages per rank holds 141 of them on rank 1 (143 - 2r
    one-block chunk forwards on rank r, rank 0's first chunk the embedding alone): with rank 1's unsharded fp32
    gradients alone that is more tensor bytes than the allocator's peak allows. No term of the model is wrong here;
    torchpre's blocks keep more than Meta's did (docs/planning.md#the-corpus-of-published-runs)."""
    (row,) = [r for r in LLAMA3_ROWS if r.gpus == 8192]
    prediction = compare(dataclasses.replace(row, virtual_stages=8, unstated=())).prediction
    block = Measured().microbatch(prediction.checked).block.saved_bytes
    assert block / 2**30 == pytest.approx(0.395, abs=0.005)
    busiest = max(prediction.ranks, key=lambda rank: rank.total_bytes)
    assert busiest.pp_rank == 1
    assert busiest.activation_bytes > 141 * block
    assert (141 * block + busiest.grad_bytes) * (1 + FRAGMENTATION) > prediction.hardware.allocator_bytes
    assert not prediction.fits

