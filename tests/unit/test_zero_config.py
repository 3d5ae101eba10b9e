"""The ZeRO and HSDP keys are checked before any process group exists, with messages that name the key."""

import pytest

from torchpre.config.job_config import JobConfig
from torchpre.config.validate import validate_config
from torchpre.errors import ConfigError


def _config(tmp_path, **keys: object) -> JobConfig:
    config = JobConfig()
    config.job.dump_folder = str(tmp_path)
    for dotted, value in keys.items():
        section, key = dotted.split("__")
        setattr(getattr(config, section), key, value)
    return config


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"optimizer__zero_stage": 4}, "optimizer.zero_stage = 4"),
        ({"optimizer__zero_stage": -1}, "optimizer.zero_stage = -1"),
        ({"parallelism__data_parallel_replicate_degree": 0}, "parallelism.data_parallel_replicate_degree = 0"),
        ({"parallelism__data_parallel_shard_degree": 0}, "parallelism.data_parallel_shard_degree = 0"),
        ({"parallelism__data_parallel_replicate_degree": 2}, "set optimizer.zero_stage = 3"),
        ({"optimizer__zero_stage": 3, "parallelism__expert_parallel_degree": 2}, "expert_parallel_degree = 2"),
        (
            {"optimizer__zero_stage": 3, "training__mixed_precision_grad": "bfloat16"},
            "training.mixed_precision_grad = bfloat16",
        ),
        (
            {
                "optimizer__zero_stage": 3,
                "parallelism__data_parallel_degree": 4,
                "parallelism__data_parallel_replicate_degree": 2,
                "parallelism__data_parallel_shard_degree": 3,
            },
            "2 x 3 = 6 must equal parallelism.data_parallel_degree = 4",
        ),
    ],
)
def test_impossible_zero_keys_are_named(tmp_path, keys, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        validate_config(_config(tmp_path, **keys))


def test_the_defaults_are_valid(tmp_path):
    validate_config(_config(tmp_path))
    validate_config(_config(tmp_path, optimizer__zero_stage=1, parallelism__data_parallel_shard_degree=2))


def test_zero3_and_hsdp_are_valid(tmp_path):
    validate_config(_config(tmp_path, optimizer__zero_stage=3))
    validate_config(_config(tmp_path, optimizer__zero_stage=3, parallelism__data_parallel_replicate_degree=2))
