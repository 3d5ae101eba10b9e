"""The ZeRO and HSDP keys are checked before any process group exists (the config's values, then the data-parallel
strategy built from them), with messages that name the key; the FSDP settings of ZeRO-3 follow them."""

import dataclasses

import pytest
import torch

from torchpre.assembly.plans import fsdp_plan
from torchpre.assembly.silent_keys import check_keys_take_effect
from torchpre.config.job_config import JobConfig
from torchpre.config.validate import validate_config
from torchpre.errors import ConfigError
from torchpre.models.llama3.args import LLAMA3_FLAVORS
from torchpre.models.registry import get_model_spec
from torchpre.parallel.data_parallel import DataParallel


def check(config: JobConfig) -> DataParallel:
    validate_config(config)
    return DataParallel.from_config(config)


def settings(config: JobConfig, pipeline: object):
    return fsdp_plan(config, pipeline, DataParallel.from_config(config))


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
        check(_config(tmp_path, **keys))


def test_the_defaults_are_valid(tmp_path):
    check(_config(tmp_path))
    check(_config(tmp_path, optimizer__zero_stage=1, parallelism__data_parallel_shard_degree=2))


def test_zero3_and_hsdp_are_valid(tmp_path):
    check(_config(tmp_path, optimizer__zero_stage=3))
    check(_config(tmp_path, optimizer__zero_stage=3, parallelism__data_parallel_replicate_degree=2))


@pytest.mark.parametrize(
    "setting, pipelined, reshard",
    [("default", False, True), ("default", True, False), ("always", True, True), ("never", False, False)],
)
def test_fsdp_reshard_after_forward_defaults_to_off_under_pipelines(tmp_path, setting, pipelined, reshard):
    """A pipeline stage runs one forward per microbatch and torch's stage keeps the gathered parameters through
    the step's backwards anyway: resharding after each forward would only add all-gathers."""
    config = _config(tmp_path, optimizer__zero_stage=3, parallelism__fsdp_reshard_after_forward=setting)
    pipeline = object() if pipelined else None
    assert settings(config, pipeline).reshard_after_forward is reshard


@pytest.mark.parametrize("model, sublayers", [("llama3", ("attention", "feed_forward")),
                                              ("moe", ("attention", "feed_forward", "moe")),
                                              ("deepseek_v3", ("attention", "feed_forward", "moe"))])  # fmt: skip
def test_fsdp_units_per_sublayer_are_the_familys(tmp_path, model, sublayers):
    """parallelism.fsdp_wrap = "sublayer" hands FSDP the family's sub-layers (`ModelBuild.sublayers`); "block" none."""
    spec = get_model_spec(model)
    config = _config(tmp_path, optimizer__zero_stage=3, model__name=model, parallelism__fsdp_wrap="sublayer")
    plan = fsdp_plan(config, None, DataParallel.from_config(config), spec.build.sublayers)
    assert plan.sublayers == sublayers
    config.parallelism.fsdp_wrap = "block"
    assert fsdp_plan(config, None, DataParallel.from_config(config), spec.build.sublayers).sublayers == ()


def test_a_family_without_sublayers_refuses_units_per_sublayer(tmp_path):
    """Start-up refuses the key where it would leave every block one unit (the hf family names no sub-layers)."""
    llama3 = get_model_spec("llama3")
    spec = dataclasses.replace(llama3, build=dataclasses.replace(llama3.build, sublayers=()))
    config = _config(tmp_path, optimizer__zero_stage=3, parallelism__fsdp_wrap="sublayer")
    with pytest.raises(ConfigError, match="parallelism.fsdp_wrap = 'sublayer': model.name = 'llama3' names no sub-lay"):
        check_keys_take_effect(config, spec, LLAMA3_FLAVORS["debugmodel"], 2048)
    check_keys_take_effect(config, llama3, LLAMA3_FLAVORS["debugmodel"], 2048)
    assert get_model_spec("hf").build.sublayers == ()


def test_fsdp_mixed_precision_follows_the_config(tmp_path):
    config = _config(tmp_path, optimizer__zero_stage=3, training__mixed_precision_param="bfloat16")
    fsdp = settings(config, None)
    assert (fsdp.param_dtype, fsdp.reduce_dtype) == (torch.bfloat16, torch.float32)
    config.optimizer.reduce_dtype = "bfloat16"
    assert settings(config, None).reduce_dtype == torch.bfloat16
    assert settings(_config(tmp_path, optimizer__zero_stage=3), None).param_dtype is None


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_strategy_answers_by_capability(stage):
    """What each ZeRO stage shards, the one place the stage number is read."""
    strategy = DataParallel(zero_stage=stage)
    capabilities = (strategy.shards_optimizer_state, strategy.shards_gradients, strategy.shards_parameters)
    assert capabilities == ((False, False, False), (True, False, False), (True, True, False), (True, True, True))[stage]
    assert strategy.reduces_each_microbatch == (stage == 2)
    assert not DataParallel(zero_stage=2, accumulate_locally=True).reduces_each_microbatch
    assert not DataParallel(zero_stage=2, overlap_grad_reduce=False).reduces_each_microbatch
