"""The names `checkpoint.exclude_from_loading` accepts are the entries a training job's checkpoint saves: one list
(`CHECKPOINT_ENTRIES`), checked here against the components a real job hands its checkpoint manager."""

import dataclasses

import pytest
import torch.distributed as dist

from torchpre.config.job_config import CHECKPOINT_ENTRIES, JobConfig
from torchpre.config.parser import parse_args
from torchpre.config.validate import validate_config
from torchpre.errors import ConfigError
from torchpre.runtime.world import Runtime
from torchpre.training.job import build_job


def test_every_entry_a_job_saves_can_be_excluded_from_loading(tmp_path):
    """A job with every component (data, optimizer, schedule, step guard) saves exactly `CHECKPOINT_ENTRIES`."""
    config = parse_args(JobConfig, ["--job.dump_folder", str(tmp_path), "--training.seq_len", "32",
                                    "--model.flavor", "debugmodel", "--training.local_batch_size", "2"])  # fmt: skip
    job = build_job(config, Runtime(1, fake_rank=0))
    try:
        saved = list(job.checkpoint_components())
    finally:
        dist.destroy_process_group()
    assert sorted(saved) == sorted(CHECKPOINT_ENTRIES)
    assert {"train", "health"} <= set(saved)
    excluding_all = dataclasses.replace(config.checkpoint, exclude_from_loading=saved)
    validate_config(dataclasses.replace(config, checkpoint=excluding_all))


def test_an_entry_no_checkpoint_saves_is_refused_with_the_saved_ones():
    config = JobConfig()
    config.checkpoint.exclude_from_loading = ["optimizer", "schedule"]
    with pytest.raises(ConfigError) as error:
        validate_config(config)
    assert str(error.value) == (
        "checkpoint.exclude_from_loading names 'schedule'; the parts are: model, optimizer, lr_scheduler, dataloader, "
        "train, rng, health."
    )
