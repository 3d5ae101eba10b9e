"""`python -m torchpre.plan --fixed`: exactly the layout the job's keys set, predicted as a search predicts it."""

import dataclasses
import json
import logging

import pytest

from torchpre.config.job_config import JobConfig
from torchpre.config.parser import parse_args
from torchpre.errors import ConfigError
from torchpre.models.llama3 import hf as llama_hf
from torchpre.models.registry import get_flavor
from torchpre.plan import main as plan_main
from torchpre.planner.dryrun import build_rank
from torchpre.planner.given_layout import check_fixed, predict_fixed
from torchpre.planner.hardware import get_hardware, save_profile
from torchpre.planner.layout_space import Layout, check
from torchpre.planner.predict import ERROR_BARS, model_flops_per_token, predict

TINY = ["--model.flavor", "tiny", "--training.seq_len", "32", "--training.global_batch_size", "8"]
FIXED_KEYS = {"memory_gib", "tensor_memory_gib", "tokens_per_s_per_gpu", "mfu", "error_bars"}


@pytest.fixture(autouse=True)
def quiet():
    logging.getLogger("torchpre").setLevel(logging.WARNING)
    yield
    logging.getLogger("torchpre").setLevel(logging.INFO)


def test_fixed_json_is_one_layout_equal_to_the_searched_prediction_of_it(capsys):
    """dp2 ZeRO-3, per-op AC, 2 sequences per microbatch on 2 GPUs: the keys a search writes for that layout, so the
    fixed prediction is the search's, number for number; memory_gib is the allocator's peak over the tensors'."""
    keys = [*TINY, "--parallelism.data_parallel_degree", "2", "--optimizer.zero_stage", "3",
            "--activation_checkpoint.mode", "selective", "--training.local_batch_size", "2"]  # fmt: skip
    plan_main([*keys, "--gpus", "2", "--gpu", "a100-80gb", "--fixed", "--json"])
    (layout,) = json.loads(capsys.readouterr().out)["layouts"]
    assert FIXED_KEYS <= set(layout)
    assert (layout["dp"], layout["tp"], layout["zero_stage"], layout["activation_checkpoint"],
            layout["microbatch_size"]) == (2, 1, 3, "selective", 2)  # fmt: skip
    base = parse_args(JobConfig, TINY)
    checked = check(Layout(dp=2, tp=1, pp=1, zero_stage=3, activation_checkpoint="selective", microbatch_size=2),
                    base, 2)  # fmt: skip
    searched = predict(checked, get_hardware("a100-80gb"), 2, model_flops_per_token(checked.config,
                                                                                     checked.model_args))
    assert layout["memory_bytes"] == searched.peak.total_bytes
    assert layout["tokens_per_sec"] == pytest.approx(searched.tokens_per_sec)
    assert layout["tokens_per_s_per_gpu"] == pytest.approx(searched.tokens_per_sec / 2)
    assert layout["memory_gib"] * 2**30 == pytest.approx(searched.reserved_bytes, abs=1)
    assert layout["memory_gib"] > layout["tensor_memory_gib"]
    assert layout["error_bars"] == ERROR_BARS


def test_fixed_keeps_the_keys_a_search_would_rewrite():
    """tp2 without sequence parallelism and block-level selective AC: a search sets sequence parallelism and per-op
    AC for every tp2 layout; --fixed predicts the job as written."""
    config = parse_args(JobConfig, [*TINY, "--parallelism.tensor_parallel_degree", "2",
                                    "--activation_checkpoint.mode", "selective",
                                    "--activation_checkpoint.selective_ac_option", "2"])  # fmt: skip
    checked = check_fixed(config, 2)
    assert not checked.config.parallelism.enable_sequence_parallel
    assert checked.config.activation_checkpoint.selective_ac_option == "2"
    assert (checked.layout.dp, checked.layout.tp) == (1, 2)
    assert predict_fixed(config, get_hardware("a100-80gb"), 2).tokens_per_sec > 0


def test_fixed_names_start_ups_refusal():
    with pytest.raises(ConfigError, match="not divisible"):
        plan_main([*TINY, "--parallelism.tensor_parallel_degree", "3", "--gpus", "3", "--fixed"])


def test_the_table_states_the_error_bars(capsys):
    plan_main([*TINY, "--gpus", "1", "--gpu", "a100-80gb", "--fixed"])
    out = capsys.readouterr().out
    assert "reserved by the CUDA allocator" in out and "stated error ±10% memory, ±20% tokens/s" in out


def test_a_fixed_pipeline_is_the_schedule_the_keys_name():
    """pp2 Interleaved1F1B with 2 stages per rank and 2-sequence microbatches: the layout --fixed predicts."""
    config = parse_args(JobConfig, [
        "--model.flavor", "debugmodel", "--training.seq_len", "64", "--training.global_batch_size", "8",
        "--training.local_batch_size", "8", "--parallelism.pipeline_parallel_degree", "2",
        "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B", "--parallelism.pipeline_parallel_virtual_stages",
        "2", "--parallelism.pipeline_parallel_microbatch_size", "2",
    ])  # fmt: skip
    checked = check_fixed(config, 2)
    assert checked.layout == Layout(dp=1, tp=1, pp=2, zero_stage=0, activation_checkpoint="none", microbatch_size=2,
                                    schedule="Interleaved1F1B", virtual_stages=2)  # fmt: skip
    assert checked.microbatches == 4


def test_the_shape_keys_shape_the_predicted_model():
    """model.n_layers set to the flavor's own depth predicts the flavor's numbers (the probes' shortened copies once
    took the key and grew back to the full depth), and a deeper model is predicted as the dry run counts it."""
    keys = [*TINY, "--parallelism.data_parallel_degree", "2", "--training.local_batch_size", "2",
            "--training.dataset", "synthetic"]  # fmt: skip
    hardware = get_hardware("h100-80gb")
    flavor = predict_fixed(parse_args(JobConfig, keys), hardware, 2)
    same = predict_fixed(parse_args(JobConfig, [*keys, "--model.n_layers", "2", "--model.dim", "64"]), hardware, 2)
    assert (same.peak.total_bytes, same.tokens_per_sec) == (flavor.peak.total_bytes, flavor.tokens_per_sec)
    deeper = parse_args(JobConfig, [*keys, "--model.n_layers", "4"])
    counted = build_rank(deeper, 2, 0, checkpoint=False)
    predicted = predict_fixed(deeper, hardware, 2)
    assert (predicted.peak.param_bytes, predicted.peak.total_bytes) == (counted.param_bytes, counted.total_bytes)
    assert predicted.tokens_per_sec < 0.6 * flavor.tokens_per_sec  # twice the blocks: about half the tokens/s
    # another shape in the same process is measured anew, not read from the probes' caches of the one before
    wider = parse_args(JobConfig, [*keys, "--model.dim", "128", "--model.n_layers", "4"])
    counted = build_rank(wider, 2, 0, checkpoint=False)
    predicted = predict_fixed(wider, hardware, 2)
    assert predicted.peak.param_bytes == counted.param_bytes
    assert predicted.peak.total_bytes == pytest.approx(counted.total_bytes, rel=0.01)


def test_a_feed_forward_width_tensor_parallelism_cannot_split_is_refused_at_start_up(tmp_path):
    """A config.json whose intermediate_size (171) two tensor-parallel ranks cannot split evenly: start-up's checks
    refuse it by name, where the layout once passed them and ended in a DTensor traceback in the probe."""
    args = dataclasses.replace(get_flavor("llama3", "tiny"), vocab_size=2048)
    config = llama_hf.hf_config(args, bos_token_id=0, eos_token_id=1, torch_dtype="bfloat16") | {
        "intermediate_size": 171}
    (tmp_path / "config.json").write_text(json.dumps(config))
    keys = [*TINY, "--model.flavor", "from_hf", "--checkpoint.initial_load_path", str(tmp_path),
            "--parallelism.tensor_parallel_degree", "2", "--gpus", "2", "--fixed"]  # fmt: skip
    with pytest.raises(ConfigError, match=r"ffn_hidden_dim = 171 .* not divisible by "
                                          r"parallelism.tensor_parallel_degree = 2.* divisor of 171 \(1, 3, 9, 19"):
        plan_main(keys)
    plan_main([*keys[:-5], "--gpus", "1", "--fixed"])  # one rank holds the whole width


def test_a_layout_fits_when_its_allocator_peak_does(capsys, tmp_path):
    """On a GPU that leaves the allocator more than the layout's tensors but less than its allocator peak (1.18 x),
    --fixed says it does not fit: what a GPU run reports is the allocator's peak (30 of 140 layouts a search once
    called fitting predicted more than the card holds)."""
    keys = [*TINY, "--parallelism.data_parallel_degree", "2", "--training.local_batch_size", "2"]
    hardware = get_hardware("h100-80gb")
    prediction = predict_fixed(parse_args(JobConfig, keys), hardware, 2)
    between = (prediction.peak.total_bytes + prediction.reserved_bytes) / 2
    small = dataclasses.replace(hardware, name="small", memory_bytes=between + hardware.reserved_bytes)
    assert prediction.peak.total_bytes < small.allocator_bytes < prediction.reserved_bytes
    assert not predict_fixed(parse_args(JobConfig, keys), small, 2).fits
    save_profile(small, tmp_path / "small.json")
    plan_main([*keys, "--gpus", "2", "--gpu", "custom", "--gpu_profile", str(tmp_path / "small.json"), "--fixed",
               "--json"])  # fmt: skip
    (layout,) = json.loads(capsys.readouterr().out)["layouts"]
    assert not layout["fits"] and layout["memory_gib"] * 2**30 > small.allocator_bytes
    wider = dataclasses.replace(small, memory_bytes=prediction.reserved_bytes + hardware.reserved_bytes)
    assert predict_fixed(parse_args(JobConfig, keys), wider, 2).fits


def test_a_prediction_timed_on_other_hardware_is_that_hardwares_prediction():
    """`Prediction.on` (what a fit of a profile's efficiencies times every row with) gives the numbers predicting on
    that hardware gives, without probing again."""
    keys = [*TINY, "--parallelism.data_parallel_degree", "2", "--training.local_batch_size", "2"]
    h100, a100 = get_hardware("h100-80gb"), get_hardware("a100-80gb")
    retimed = predict_fixed(parse_args(JobConfig, keys), h100, 2).on(a100)
    direct = predict_fixed(parse_args(JobConfig, keys), a100, 2)
    assert retimed.step == direct.step and retimed.tokens_per_sec == direct.tokens_per_sec
    assert retimed.tokens_per_sec != predict_fixed(parse_args(JobConfig, keys), h100, 2).tokens_per_sec
