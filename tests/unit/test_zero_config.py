"""The ZeRO and HSDP keys are checked before any process group exists, with messages that name the key; the
FSDP settings of ZeRO-3 follow them."""

import pytest
import torch

from torchpre.config.job_config import JobConfig
from torchpre.config.validate import validate_config
from torchpre.errors import ConfigError
from torchpre.training.model import fsdp_plan


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


@pytest.mark.parametrize(
    "setting, pipelined, reshard",
    [("default", False, True), ("default", True, False), ("always", True, True), ("never", False, False)],
)
def test_fsdp_reshard_after_forward_defaults_to_off_under_pipelines(tmp_path, setting, pipelined, reshard):
    """A pipeline stage runs one forward per microbatch and torch's stage keeps the gathered parameters through
    the step's backwards anyway: resharding after each forward would only add all-gathers."""
    config = _config(tmp_path, optimizer__zero_stage=3, parallelism__fsdp_reshard_after_forward=setting)
    pipeline = object() if pipelined else None
    assert fsdp_plan(config, pipeline).reshard_after_forward is reshard


def test_fsdp_mixed_precision_follows_the_config(tmp_path):
    config = _config(tmp_path, optimizer__zero_stage=3, training__mixed_precision_param="bfloat16")
    plan = fsdp_plan(config, None)
    assert (plan.param_dtype, plan.reduce_dtype) == (torch.bfloat16, torch.float32)
    config.optimizer.reduce_dtype = "bfloat16"
    assert fsdp_plan(config, None).reduce_dtype == torch.bfloat16
    assert fsdp_plan(_config(tmp_path, optimizer__zero_stage=3), None).param_dtype is None
