"""The schedule table is the one place that names pipeline schedules: torch, config validation, --help and the
pipeline all follow its rows."""

import dataclasses
from typing import get_args, get_type_hints

import pytest
from torch.distributed.pipelining import schedules

from torchpre.config.job_config import JobConfig, Parallelism
from torchpre.config.parser import format_help, parse_args
from torchpre.config.validate import validate_config
from torchpre.errors import ConfigError
from torchpre.parallel.pipeline import schedule_class
from torchpre.step_rules import schedules as table


@pytest.mark.parametrize("row", table.SCHEDULES, ids=lambda row: row.name)
def test_rows_match_torch(row):
    """A row's class exists in torch and its multi-stage fact is torch's; a V needs two stages per rank."""
    cls = getattr(schedules, row.torch_class)
    assert issubclass(cls, schedules.PipelineScheduleMulti) == row.multi_stage
    assert issubclass(cls, schedules.PipelineScheduleSingle) != row.multi_stage
    assert row.placement == "loop" or row.multi_stage


def test_alias_resolves_to_its_row():
    assert table.get_schedule("AFAB") is table.get_schedule("GPipe")
    assert schedule_class(table.get_schedule("AFAB")) is schedules.ScheduleGPipe


def test_config_choices_and_help_list_every_row():
    choices = get_args(get_type_hints(Parallelism)["pipeline_parallel_schedule"])
    names = [name for row in table.SCHEDULES for name in (row.name, *row.aliases)]
    assert list(choices) == names
    help_text = format_help(JobConfig, "train.py")
    for name in names:
        assert name in help_text
    assert "AFAB is GPipe" in help_text


def test_unknown_schedule_names_the_key_and_the_closest_row():
    with pytest.raises(ConfigError, match="'parallelism.pipeline_parallel_schedule'.*did you mean '1F1B'"):
        parse_args(JobConfig, ["--parallelism.pipeline_parallel_schedule", "1f1b"])
    with pytest.raises(ConfigError, match="parallelism.pipeline_parallel_schedule = 'DualPipe'.*'DualPipeV'"):
        table.get_schedule("DualPipe")


def _validate_with_validation(schedule: str) -> None:
    config = JobConfig()
    config.validation.enable = True
    config.parallelism.pipeline_parallel_degree = 2
    config.parallelism.pipeline_parallel_schedule = schedule
    validate_config(config)


@pytest.mark.parametrize("row", table.SCHEDULES, ids=lambda row: row.name)
def test_forward_only_fact_drives_validation(row):
    """Validation under pipelining is accepted exactly for the rows that can run forward-only."""
    if row.forward_only:
        _validate_with_validation(row.name)
    else:
        with pytest.raises(ConfigError, match=f"validation.enable: .* '{row.name}'"):
            _validate_with_validation(row.name)


def test_changing_a_row_changes_validation_and_placement(monkeypatch):
    """Validation and stage placement read the row, not a list of names of their own."""
    gpipe = table.get_schedule("GPipe")
    _validate_with_validation("GPipe")
    assert table.get_schedule("GPipe").stage_ids(1, 4, 2) == [1, 5]
    monkeypatch.setitem(table._BY_NAME, "GPipe", dataclasses.replace(gpipe, forward_only=False, placement="v"))
    with pytest.raises(ConfigError, match="cannot run it forward-only"):
        _validate_with_validation("GPipe")
    assert table.get_schedule("GPipe").stage_ids(1, 4, 2) == [1, 6]
