"""Each number key's range is declared with its field (`torchpre.config.bounds`) and checked by `validate_config`:
every declared bound admits its key's default and refuses a value past its end, naming the key."""

import dataclasses
import math

import pytest

from torchpre.config.bounds import Bound, at_least, between, positive
from torchpre.config.job_config import JobConfig
from torchpre.config.validate import validate_config
from torchpre.errors import ConfigError


def bounded_keys() -> list[tuple[str, str, Bound]]:
    config = JobConfig()
    return [
        (section.name, field.name, field.metadata["bound"])
        for section in dataclasses.fields(config)
        for field in dataclasses.fields(getattr(config, section.name))
        if "bound" in field.metadata
    ]


def just_outside(bound: Bound) -> float:
    """The first value below the range (an integer one for a closed integer end)."""
    return bound.low if bound.low_open else bound.low - 1


def test_the_declared_bounds_cover_the_keys_that_were_range_checked_by_hand():
    assert len(bounded_keys()) == 56  # + pipeline_parallel_embedding_layers, _output_layers


@pytest.mark.parametrize("section, key, bound", bounded_keys(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_bound_admits_its_default_and_refuses_a_value_below_it(tmp_path, section, key, bound):
    config = JobConfig()
    config.job.dump_folder = str(tmp_path)
    assert bound.admits(getattr(getattr(config, section), key))
    value = just_outside(bound)
    if value in bound.also:
        value -= 1
    setattr(getattr(config, section), key, value)
    with pytest.raises(ConfigError, match=f"^{section}.{key} = {value}: "):
        validate_config(config)


@pytest.mark.parametrize(
    "bound, value, admitted",
    [
        (at_least(1), 1, True), (at_least(1), 0, False), (at_least(0), math.inf, False), (at_least(0), math.nan, False),
        (at_least(1, also=(-1,)), -1, True), (at_least(1, also=(-1,)), -2, False),
        (positive(), 0.0, False), (positive(), 1e-9, True),
        (between(0, 1, high_open=True), 1.0, False), (between(0, 1, high_open=True), 0.0, True),
        (between(0, 1), 1.0, True), (between(0, 1, low_open=True), 0.0, False),
    ],
)  # fmt: skip
def test_a_bound_admits_exactly_its_range(bound, value, admitted):
    assert bound.admits(value) is admitted


@pytest.mark.parametrize(
    "bound, value, message",
    [
        (at_least(2), 1, "training.spike_window = 1: it must be at least 2."),
        (positive(), 0, "training.spike_window = 0: it must be positive."),
        (between(0, 1, high_open=True), 1, "training.spike_window = 1: it must be in [0, 1)."),
        (between(0, 1, low_open=True, message="use 0.5."), 0, "training.spike_window = 0: use 0.5."),
    ],
)
def test_a_refusal_names_the_key_the_value_and_the_range(bound, value, message):
    with pytest.raises(ConfigError) as error:
        bound.check("training.spike_window", value)
    assert str(error.value) == message
