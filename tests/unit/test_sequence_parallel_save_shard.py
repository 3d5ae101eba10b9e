"""parallelism.sequence_parallel_save_shard is refused in preflight, naming what to change, where it cannot run:
under compile.enable (saved-tensor hooks do not trace) and for a family without a plan for it. Its numbers (bitwise
gradients, the bytes saved, the extra all-gathers) are in tests/distributed/test_tensor_parallel.py."""

import re
from pathlib import Path

import pytest

from torchpre.config.job_config import JobConfig
from torchpre.config.parser import parse_args
from torchpre.errors import ConfigError
from torchpre.training import preflight

TP2_SP = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_sequence_parallel"]
SAVE = ["--parallelism.sequence_parallel_save_shard"]


def _config(tmp_path: Path, *keys: str) -> JobConfig:
    return parse_args(JobConfig, ["--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder",
                                  str(tmp_path), "--training.seq_len", "64", *keys])  # fmt: skip


@pytest.mark.parametrize("family", ["llama3", "moe", "deepseek_v3"])
def test_the_families_with_a_plan_accept_the_key(tmp_path: Path, family: str) -> None:
    preflight.preflight(_config(tmp_path, "--model.name", family, *TP2_SP, *SAVE), 2)


def test_compile_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=re.escape("torch.compile cannot trace: turn off compile.enable")):
        preflight.preflight(_config(tmp_path, *TP2_SP, *SAVE, "--compile.enable"), 2)


def test_a_family_without_a_plan_is_refused(tmp_path: Path) -> None:
    hf = ["--model.name", "hf", "--model.hf_config", "assets/hf_configs/qwen2_tiny.json"]
    with pytest.raises(ConfigError, match=re.escape("model.name = 'hf' has no plan that saves the sequence shard")):
        preflight.preflight(_config(tmp_path, *hf, *TP2_SP, *SAVE), 2)


def test_without_sequence_parallelism_the_key_changes_nothing_and_is_accepted(tmp_path: Path) -> None:
    preflight.preflight(_config(tmp_path, "--parallelism.tensor_parallel_degree", "2", *SAVE, "--compile.enable"), 2)
