"""model.rope_*: the RoPE base and Llama 3.1-style scaling from the config, for the families built on Llama 3's args;
refused, naming the key, for a family that does not read them and for values that make no frequencies."""

import math

import pytest
import torch

from tests.launch import REPO
from tests.unit.test_model import meta_apply_scaling
from torchpre.assembly.args import model_args
from torchpre.assembly.rope import rope_record
from torchpre.config.job_config import JobConfig
from torchpre.config.parser import parse_args
from torchpre.config.validate import check_section_bounds
from torchpre.data.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer
from torchpre.errors import ConfigError
from torchpre.models.llama3.args import LLAMA3_FLAVORS, RopeScaling
from torchpre.models.llama3.model import Transformer

TOKENIZER = load_tokenizer(DEFAULT_TOKENIZER_PATH)
TINY = ["--model.flavor", "tiny", "--training.seq_len", "64"]
HF_LLAMA = str(REPO / "assets/hf_configs/llama_tiny.json")


def args_of(*argv: str):
    """The model args as every entry point reaches them: after the keys' own bounds (model.rope_theta's, ...)."""
    config = parse_args(JobConfig, [*TINY, *argv])
    check_section_bounds(config)
    return model_args(config, TOKENIZER)


def test_unset_keys_keep_the_flavors_rope():
    assert args_of().rope_theta == LLAMA3_FLAVORS["tiny"].rope_theta and args_of().rope_scaling is None
    one_b = model_args(parse_args(JobConfig, ["--model.flavor", "1B"]), TOKENIZER)
    assert one_b.rope_scaling == LLAMA3_FLAVORS["1B"].rope_scaling
    off = model_args(parse_args(JobConfig, ["--model.flavor", "1B", "--model.rope_scaling_factor", "1"]), TOKENIZER)
    assert off.rope_scaling is None  # 1 = no scaling, even over a flavor that has it


def test_the_scaled_rope_table_of_the_config_equals_llama31s_formula():
    """A tiny model given a base of 10,000 and factor-4 scaling over an original 64-token context: its RoPE cache
    holds cos/sin of position x Meta's scaled frequency, computed here per frequency in float64."""
    args = args_of(
        "--model.rope_theta", "10000", "--model.rope_scaling_factor", "4",
        "--model.rope_original_max_seq_len", "64", "--model.rope_high_freq_factor", "8",
    )  # fmt: skip
    assert args.rope_scaling == RopeScaling(4.0, 1.0, 8.0, 64)  # low: Llama 3.1's 1, as the flavor has none
    base = [10000.0 ** (-i / args.head_dim) for i in range(0, args.head_dim, 2)]
    scaled = meta_apply_scaling(base, args.rope_scaling)
    kept = sum(s == b for s, b in zip(scaled, base))
    divided = sum(math.isclose(s, b / 4) for s, b in zip(scaled, base))
    assert kept and divided and kept + divided < len(base), "all three regimes are exercised"
    angles = torch.outer(torch.arange(64, dtype=torch.float64), torch.tensor(scaled, dtype=torch.float64))
    cache = Transformer(args).rope_cache.double()  # each pair's cos twice, then its (-sin, sin)
    torch.testing.assert_close(cache[:, : args.head_dim : 2], angles.cos(), atol=2e-5, rtol=0)
    torch.testing.assert_close(cache[:, args.head_dim + 1 :: 2], angles.sin(), atol=2e-5, rtol=0)
    assert rope_record(args) == {
        "rope_theta": 10000.0, "rope_scaling_factor": 4.0, "rope_low_freq_factor": 1.0,
        "rope_high_freq_factor": 8.0, "rope_original_max_seq_len": 64.0,
    }  # fmt: skip


def test_moe_reads_the_keys():
    config = parse_args(JobConfig, ["--model.name", "moe", "--model.flavor", "tiny", "--model.rope_theta", "123"])
    assert model_args(config, TOKENIZER).rope_theta == 123.0


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["--model.rope_theta", "-1"], ["model.rope_theta = -1.0", "positive"]),
        (["--model.rope_scaling_factor", "0.5"], ["model.rope_scaling_factor = 0.5", "at least 1"]),
        (["--model.rope_scaling_factor", "4"], ["model.rope_original_max_seq_len", "model.flavor = 'tiny'"]),
        (
            ["--model.rope_scaling_factor", "4", "--model.rope_original_max_seq_len", "16",
             "--model.rope_low_freq_factor", "4"],
            ["model.rope_low_freq_factor = 4.0", "model.rope_high_freq_factor = 4.0", "0 < low < high"],
        ),
        (["--model.rope_original_max_seq_len", "16"], ["model.rope_original_max_seq_len = 16", "which is off"]),
        (
            ["--model.name", "hf", "--model.hf_config", HF_LLAMA, "--model.rope_theta", "1e6"],
            ["model.rope_theta = 1000000.0", "model.name = 'hf'", "model.hf_config"],
        ),
    ],
    ids=["negative-theta", "factor-below-1", "no-original-context", "low-not-below-high", "detail-without-scaling",
         "hf-family"],
)  # fmt: skip
def test_bad_rope_values_are_refused_naming_the_key(argv, fragments):
    with pytest.raises(ConfigError) as error:
        args_of(*argv)
    for fragment in fragments:
        assert fragment in str(error.value)
