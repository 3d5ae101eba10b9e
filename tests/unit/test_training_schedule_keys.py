"""training.batch_rampup and each [[training.data_stages]] table are checked with the other keys, by
`validate_config`, with the messages the ramp and the stage table give when they are built."""

import pytest

from torchpre.config.job_config import DataStage, JobConfig
from torchpre.config.validate import validate_config
from torchpre.errors import ConfigError


@pytest.mark.parametrize(
    "training, message",
    [
        ({"batch_rampup": "a,2,12", "global_batch_size": 8}, 'training.batch_rampup = "a,2,12": expected "start,'),
        ({"batch_rampup": "2,2,12"}, "ramps the global batch up to training.global_batch_size, which is -1"),
        ({"batch_rampup": "2,4,12", "global_batch_size": 8}, "choose an increment that divides 8 - 2 = 6."),
        ({"data_stages": [DataStage(), DataStage()]}, r"training.data_stages stage 2 \('stage-2'\) has no start"),
        ({"data_stages": [DataStage(start_step=0, start_fraction=0.0)]}, "sets start_step and start_fraction"),
        ({"data_stages": [DataStage(), DataStage(start_fraction=1.0)]}, r"start_fraction = 1.0 must be in \[0, 1\)"),
        ({"data_stages": [DataStage(seq_len=-1)]}, "seq_len = -1 must be positive"),
        ({"data_stages": [DataStage(mixture={"x": 1.0})]}, "needs training.dataset = 'shards' \\(it is 'stdlib'\\)"),
    ],
)
def test_the_schedule_keys_are_refused_before_any_work(tmp_path, training, message):
    config = JobConfig()
    config.job.dump_folder = str(tmp_path)
    for key, value in training.items():
        setattr(config.training, key, value)
    with pytest.raises(ConfigError, match=message):
        validate_config(config)
