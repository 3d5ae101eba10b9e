"""The step plan: the global-batch ramp against Megatron's formula, the data-stage table (which stage at which step,
its start from a step, a fraction or the WSD decay, its refusals), the samples each step consumes, and the
`[[training.data_stages]]` TOML shape (read, written back, refused on the command line)."""

import pytest

from torchpre.config.job_config import DataStage, JobConfig
from torchpre.config.parser import parse_args, to_toml
from torchpre.config.training_schedule import ramp_values
from torchpre.errors import ConfigError
from torchpre.step_rules.batch import BatchSizes
from torchpre.step_rules.ramp import BatchRamp
from torchpre.training.stages import StageTable, stages_change
from torchpre.training.step_plan import StepPlan


def megatron_global_batch(start: int, increment: int, samples: int, final: int, consumed: int) -> int:
    """Megatron-LM's RampupBatchsizeNumMicroBatches.update (megatron/core/num_microbatches_calculator.py), as
    written there: float samples per increment, int() of the quotient."""
    per_increment = samples / ((final - start) // increment)
    if consumed > samples:
        return final
    return start + int(consumed / per_increment) * increment


@pytest.mark.parametrize("ramp", [(2, 2, 12, 8), (16, 16, 1000, 128), (3, 6, 100, 27), (32, 32, 777, 1024)])
def test_the_ramp_gives_megatrons_batch_at_every_step(ramp):
    start, increment, samples, final = ramp
    parsed = BatchRamp(start, increment, samples, final)
    consumed, sizes = 0, []
    while consumed <= samples + final:
        size = parsed.global_batch(consumed)
        assert size == megatron_global_batch(start, increment, samples, final, consumed)
        sizes.append(size)
        consumed += size
    assert sizes[0] == start and sizes[-1] == final
    assert sizes == sorted(sizes)


def test_the_ramp_of_the_docs_example_by_step():
    """"2,2,12" up to 8: 3 increments, one every 4 samples; the steps consume 2, 2, 4, 6, then 8."""
    ramp = BatchRamp(*ramp_values("2,2,12", 8), 8)
    consumed, sizes = 0, []
    for _ in range(6):
        sizes.append(ramp.global_batch(consumed))
        consumed += sizes[-1]
    assert sizes == [2, 2, 4, 6, 8, 8]
    assert BatchRamp(4, 2, 0, 8).global_batch(0) == 8  # no ramp samples: the final batch at once
    assert ramp_values("", 8) is None


@pytest.mark.parametrize(
    "text, final, message",
    [
        ("2,2", 8, 'training.batch_rampup = "2,2": expected "start,increment,samples"'),
        ("a,2,12", 8, "three integers"),
        ("0,2,12", 8, "start and increment must be at least 1"),
        ("16,2,12", 8, "starts at 16 sequences, more than training.global_batch_size = 8"),
        ("2,4,12", 8, "choose an increment that divides 8 - 2 = 6"),
        ("2,2,12", -1, "training.global_batch_size, which is -1"),
    ],
)
def test_a_bad_ramp_is_refused_by_name(text, final, message):
    with pytest.raises(ConfigError, match="training.batch_rampup") as error:
        ramp_values(text, final)
    assert message in str(error.value)


def test_a_ramp_that_a_round_of_local_batch_x_dp_does_not_divide_is_refused():
    plan([], ramp="2,2,12", dp=1)
    with pytest.raises(ConfigError) as error:
        plan([], ramp="2,2,12", dp=2)
    assert "global batches 2, 4, 6, 8, and 2, 6 are not divisible by training.local_batch_size x data-parallel" in (
        str(error.value)
    )
    assert "multiples of 4" in str(error.value)


def config(stages: list[DataStage], steps: int = 10, **training) -> JobConfig:
    job = JobConfig()
    job.training.steps, job.training.seq_len, job.training.data_stages = steps, 32, stages
    job.lr_scheduler.warmup_steps, job.lr_scheduler.decay_ratio = 2, 0.25
    for key, value in training.items():
        setattr(job.training, key, value)
    return job


def test_the_stage_of_each_step_from_a_step_a_fraction_and_the_decay():
    """10 steps, warmup 2, decay_ratio 0.25: the decay is the last round(0.25 x 8) = 2 steps, from step 8."""
    table = StageTable.from_config(config([
        DataStage(name="main"), DataStage(start_step=3, seq_len=64), DataStage(start_fraction=0.6),
        DataStage(name="anneal", start_at_decay=True, seq_len=16),
    ]))  # fmt: skip
    assert [stage.start_step for stage in table.stages] == [0, 3, 6, 8]
    assert [table.at(step).index for step in range(10)] == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]
    assert [table.at(step).seq_len for step in (2, 3, 7, 8)] == [32, 64, 32, 16]
    assert [stage.name for stage in table.stages] == ["main", "stage-2", "stage-3", "anneal"]
    assert table.max_seq_len == 64
    assert [s.start_step for s in StageTable.from_config(config([])).stages] == [0]  # none: one stage, the job's


@pytest.mark.parametrize(
    "stages, message",
    [
        ([DataStage(start_step=2)], "the first stage ('stage-1') starts at step 2"),
        ([DataStage(), DataStage(start_step=5), DataStage(start_step=5)], "stage 3 ('stage-3') starts at step 5, "
         "not after stage 2 ('stage-2') at step 5: stages overlap or go backwards"),
        ([DataStage(), DataStage(start_step=6), DataStage(start_fraction=0.4)], "starts at step 4, not after stage 2"),
        ([DataStage(), DataStage()], "stage 2 ('stage-2') has no start"),
        ([DataStage(), DataStage(start_step=3, start_at_decay=True)], "sets start_step and start_at_decay"),
        ([DataStage(), DataStage(start_step=10)], "starts at step 10, but the run ends after training.steps = 10"),
        ([DataStage(), DataStage(start_fraction=1.0)], "start_fraction = 1.0 must be in [0, 1)"),
        ([DataStage(), DataStage(start_step=3, mixture={"/data/a": 1.0})], "needs training.dataset = 'shards'"),
        ([DataStage(), DataStage(start_step=3, seq_len=-1)], "seq_len = -1 must be positive"),
    ],
)
def test_a_bad_stage_list_is_refused_by_name(stages, message):
    with pytest.raises(ConfigError, match="training.data_stages") as error:
        StageTable.from_config(config(stages))
    assert message in str(error.value)


def test_a_decay_stage_without_a_decay_is_refused():
    job = config([DataStage(), DataStage(start_at_decay=True)])
    job.lr_scheduler.decay_ratio = 0.0
    with pytest.raises(ConfigError, match="lr_scheduler.decay_ratio = 0.0 never decays"):
        StageTable.from_config(job)


def plan(stages: list[DataStage], ramp: str = "", unit: str = "sequences", dp: int = 1) -> StepPlan:
    job = config(stages, batch_rampup=ramp, global_batch_size=8, local_batch_size=2, global_batch_unit=unit)
    return StepPlan.from_config(job, BatchSizes(8, 8 // (2 * dp), 2, 32), StageTable.from_config(job), dp)


def test_each_step_consumes_its_own_batch_and_a_stage_starts_at_its_step():
    """The data position advances by each step's global batch (not the final one): the stage at step 4 begins at
    sample 2 + 2 + 4 + 6 = 14."""
    steps = list(plan([DataStage(), DataStage(start_step=4, seq_len=64)], ramp="2,2,12").walk())
    assert [(step, consumed) for step, consumed, _ in steps] == [(0, 0), (1, 2), (2, 4), (3, 8), (4, 14)]
    assert [shape.sizes.accumulation_steps for _, _, shape in steps] == [1, 1, 2, 3, 4]
    assert [shape.sizes.seq_len for _, _, shape in steps] == [32, 32, 32, 32, 64]
    table = plan([DataStage(), DataStage(start_step=4, seq_len=64)], ramp="2,2,12")
    assert table.first_sample(table.stages.stages[1]) == 14


def test_a_stage_in_tokens_keeps_the_tokens_per_step_and_refuses_to_overlap_the_ramp():
    shapes = plan([DataStage(), DataStage(start_step=2, seq_len=64)], unit="tokens")
    assert [shapes.at(step, 0).sizes.global_batch_size for step in (0, 2)] == [8, 4]  # 256 tokens per step
    with pytest.raises(ConfigError, match="training.batch_rampup is still ramping"):
        plan([DataStage(), DataStage(start_step=2, seq_len=64)], ramp="2,2,12", unit="tokens").check(10, print)
    plan([DataStage(), DataStage(start_step=5, seq_len=64)], ramp="2,2,12", unit="tokens").check(10, lambda n: None)


def test_a_stage_whose_batch_dp_does_not_divide_is_refused():
    odd = plan([DataStage(), DataStage(start_step=2, seq_len=128)], unit="tokens", dp=2)  # 8 x 32 / 128 = 2
    odd.base = BatchSizes(4, 1, 2, 32)  # 4 x 32 / 128 = 1 sequence: no round of 2 x 2
    with pytest.raises(ConfigError, match="At step 2 .* the global batch is 1 sequences, not divisible"):
        odd.check(10, lambda n: None)


def test_stages_read_from_toml_and_written_back(tmp_path):
    path = tmp_path / "stages.toml"
    path.write_text(
        '[training]\nsteps = 10\ndataset = "shards"\nbatch_rampup = "2,2,12"\n'
        '[[training.data_stages]]\nname = "main"\nmixture = { "/data/web" = 0.7, "/data/code" = 0.3 }\n'
        '[[training.data_stages]]\nname = "anneal"\nstart_at_decay = true\nmixture = { "/data/hq" = 1 }\n'
        "seq_len = 64\n"
    )
    job = parse_args(JobConfig, ["--job.config_file", str(path)])
    assert job.training.data_stages == [
        DataStage(name="main", mixture={"/data/web": 0.7, "/data/code": 0.3}),
        DataStage(name="anneal", start_at_decay=True, mixture={"/data/hq": 1.0}, seq_len=64),
    ]
    (tmp_path / "dump.toml").write_text(to_toml(job))
    again = parse_args(JobConfig, ["--job.config_file", str(tmp_path / "dump.toml")])
    assert again.training == job.training
    with pytest.raises(ConfigError, match=r"set it in the TOML file, as \[\[training.data_stages\]\] tables"):
        parse_args(JobConfig, ["--training.data_stages", "x"])
    path.write_text("[[training.data_stages]]\nstart_stp = 3\n")
    with pytest.raises(ConfigError, match=r"Unknown key 'start_stp' in \[\[training.data_stages\]\] number 1"):
        parse_args(JobConfig, ["--job.config_file", str(path)])


def test_a_resume_that_changes_a_future_stage_notes_it_and_one_that_rewrites_the_past_warns():
    """Stage 2 starts at step 3. Resumed at step 2 its new mixture is a note (it has not started); resumed at step 5
    the same change rewrites steps 3 and 4, which a warning says, with the stage to add instead."""
    def table(folder: str) -> StageTable:
        return StageTable.from_config(config([DataStage(), DataStage(start_step=3, mixture={folder: 1.0})],
                                             dataset="shards"))  # fmt: skip

    saved, moved = table("/a"), table("/b")
    assert stages_change(saved, saved, 5, 10) == ([], [])
    warnings, notes = stages_change(saved, moved, 2, 10)
    assert warnings == []
    assert notes == [
        "training.data_stages: the steps from 2 on change from from step 2: the job's data at seq_len 32; from step 3: "
        "{/a=1} at seq_len 32 to from step 2: the job's data at seq_len 32; from step 3: {/b=1} at seq_len 32 (they "
        "have not been taken yet, so the run takes them as configured now)"
    ]
    warnings, notes = stages_change(saved, moved, 5, 10)
    assert len(warnings) == 1 and len(notes) == 1
    assert "it trained from step 0: the job's data at seq_len 32; from step 3: {/a=1} at seq_len 32" in warnings[0]
    assert "add a stage with start_step = 5" in warnings[0]


def test_the_peak_shape_a_memory_estimate_holds_is_the_largest_batch_and_the_longest_stage():
    """The dry run sizes activations for the most sequences per DP rank (the ramp's end, 8 on dp1, 4 on dp2) and
    the longest stage's seq_len (64), though the first step runs 2 sequences of 32."""
    stages = [DataStage(), DataStage(start_step=4, seq_len=64)]
    assert plan(stages, ramp="2,2,12").peak(10) == (8, 64)
    assert plan(stages, ramp="4,4,12", dp=2).peak(10) == (4, 64)
    assert plan(stages, ramp="2,2,12").peak(3) == (4, 32)  # 3 steps: batches 2, 2, 4, the first stage only
    assert plan([]).peak(10) == (8, 32)


def test_a_ramp_over_no_samples_or_into_a_stage_of_another_seq_len_is_warned_of():
    """Both run as configured (Megatron accepts 0 ramp samples; a ramp in sequences may cross a stage), but neither is
    likely what was meant: the trainer logs these warnings at start-up."""
    (none,) = plan([DataStage()], ramp="2,2,0").warnings(10)
    assert 'training.batch_rampup = "2,2,0" ramps over 0 samples' in none and "final global batch of 8" in none
    (crossing,) = plan([DataStage(), DataStage(start_step=2, seq_len=64)], ramp="2,2,12").warnings(10)
    assert "still ramping at step 2 (4 of its 12 samples)" in crossing and "64-token sequences" in crossing
    assert plan([DataStage(), DataStage(start_step=5, seq_len=64)], ramp="2,2,12").warnings(10) == []  # ramp done
    assert plan([DataStage(), DataStage(start_step=2, seq_len=64)], ramp="2,2,12").warnings(2) == []  # not reached
    assert plan([DataStage(), DataStage(start_step=2)], ramp="2,2,12").warnings(10) == []  # same seq_len
