"""Pipeline splitting, stage placement and the errors that stop a bad pipeline config early."""

from types import SimpleNamespace

import pytest
import torch

from torchpre.errors import ConfigError
from torchpre.models.llama3.args import LLAMA3_FLAVORS
from torchpre.models.llama3.model import Transformer
from torchpre.models.llama3.spec import SPEC as LLAMA3
from torchpre.parallel.pipeline import PipelinePlan, prune_to, split_layers
from torchpre.step_rules.schedules import get_schedule

LAYERS = [f"layers.{i}" for i in range(6)]


def parallelism(schedule="1F1B", pp=2, microbatch_size=1, virtual_stages=1, split_points=(), embedding_layers=0):
    return SimpleNamespace(
        pipeline_parallel_schedule=schedule,
        pipeline_parallel_degree=pp,
        pipeline_parallel_microbatch_size=microbatch_size,
        pipeline_parallel_virtual_stages=virtual_stages,
        pipeline_parallel_split_points=list(split_points),
        pipeline_parallel_embedding_layers=embedding_layers,
        pipeline_parallel_output_layers=0,
    )


def plan(sequences=8, **kwargs) -> PipelinePlan:
    return PipelinePlan.from_config(parallelism(**kwargs), lambda n: split_layers(LAYERS, n), sequences)


def test_even_and_uneven_splits():
    assert split_layers(LAYERS, 2) == [LAYERS[:3], LAYERS[3:]]
    assert [len(s) for s in split_layers(LAYERS, 4)] == [2, 2, 1, 1]
    assert split_layers(LAYERS, 2, ["layers.1"]) == [LAYERS[:1], LAYERS[1:]]


def test_split_errors_name_the_problem():
    with pytest.raises(ConfigError, match="6 layers, fewer than the 8 pipeline stages"):
        split_layers(LAYERS, 8)
    with pytest.raises(ConfigError, match="'layers.9', which is not a layer"):
        split_layers(LAYERS, 2, ["layers.9"])
    with pytest.raises(ConfigError, match="has 2 entries; 2 stages need 1"):
        split_layers(LAYERS, 2, ["layers.1", "layers.2"])
    with pytest.raises(ConfigError, match="increasing order"):
        split_layers(LAYERS, 3, ["layers.4", "layers.2"])


def test_llama_stages_put_embedding_first_and_head_last():
    args = LLAMA3_FLAVORS["debugmodel"]
    assert LLAMA3.pipeline_stages(args, 2) == [
        ["tok_embeddings", "layers.0", "layers.1", "layers.2"],
        ["layers.3", "layers.4", "layers.5", "norm", "output"],
    ]


def test_loop_and_v_placement():
    assert get_schedule("Interleaved1F1B").stage_ids(1, 2, 2) == [1, 3]
    assert get_schedule("ZBVZeroBubble").stage_ids(0, 2, 2) == [0, 3]
    assert get_schedule("DualPipeV").stage_ids(1, 4, 2) == [1, 6]
    assert [get_schedule("ZBVZeroBubble").stage_rank(s, 2) for s in range(4)] == [0, 1, 1, 0]
    assert [get_schedule("LoopedBFS").stage_rank(s, 2) for s in range(4)] == [0, 1, 0, 1]


def test_plan_counts_stages_and_microbatches():
    p = plan(sequences=8, schedule="Interleaved1F1B", virtual_stages=2, microbatch_size=2)
    assert (p.num_stages, p.n_microbatches) == (4, 4)
    assert plan(schedule="ZBVZeroBubble").stages_per_rank == 2
    assert plan(schedule="AFAB").schedule.name == "GPipe"


def test_a_smaller_step_runs_fewer_microbatches_of_the_set_size():
    """A global-batch ramp's early steps have fewer rows: they run as microbatches of
    pipeline_parallel_microbatch_size (not the final batch's count, which would leave some empty)."""
    p = plan(sequences=12, microbatch_size=2)
    assert (p.n_microbatches, p.microbatches_in(12), p.microbatches_in(4)) == (6, 6, 2)
    built = PipelinePlan.build([LAYERS[:3], LAYERS[3:]], pp=2, n_microbatches=4)
    assert (built.microbatches_in(8), built.microbatches_in(4)) == (4, 4)  # no size given: the plan's number


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(schedule="1F1B", virtual_stages=2), "runs one stage per rank"),
        (dict(schedule="ZBVZeroBubble", virtual_stages=3), "exactly 2 stages per rank"),
        (dict(sequences=2, schedule="1F1B", pp=4), "at least as many microbatches as stages \\(4\\)"),
        (dict(sequences=2, schedule="ZBVZeroBubble"), "at least as many microbatches as stages \\(4\\)"),
        (dict(sequences=9, schedule="Interleaved1F1B", pp=4, virtual_stages=1), "Use a multiple of 4"),
        (dict(sequences=8, microbatch_size=3), "pipeline_parallel_microbatch_size = 3"),
        (dict(schedule="Zigzag"), "not a schedule"),
    ],
)
def test_plan_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        plan(**kwargs)


def test_pruned_stages_compose_to_the_full_model():
    args = LLAMA3_FLAVORS["tiny"]
    model = Transformer(args)
    model.init_weights(0)
    names = LLAMA3.pipeline_stages(args, 2)
    first, second = (prune_to(model, stage) for stage in names)
    assert first.output is None and second.tok_embeddings is None
    assert list(first.layers) == ["0"] and list(second.layers) == ["1"]
    tokens = torch.randint(0, args.vocab_size, (2, 8))
    torch.testing.assert_close(second(first(tokens)), model(tokens), rtol=0, atol=0)


def test_pipeline_stages_read_off_any_model():
    from torchpre.parallel import PipelinePlan, pipeline_stages

    with torch.device("meta"):
        model = Transformer(LLAMA3_FLAVORS["debugmodel"])
    assert pipeline_stages(model, layers_per_stage=[1, 2, 3]) == [
        ["tok_embeddings", "layers.0"],
        ["layers.1", "layers.2"],
        ["layers.3", "layers.4", "layers.5", "norm", "output"],
    ]
    assert pipeline_stages(model, 2, split_points=["layers.1"])[0] == ["tok_embeddings", "layers.0"]
    with pytest.raises(ConfigError, match="add up to the 6 blocks"):
        pipeline_stages(model, layers_per_stage=[1, 2])
    with pytest.raises(ConfigError, match="no submodule 'h'"):
        pipeline_stages(model, 2, blocks="h")
    plan = PipelinePlan.build(pipeline_stages(model, 4), pp=2, schedule="Interleaved1F1B", n_microbatches=4)
    assert (plan.stages_per_rank, plan.stage_ids(1)) == (2, [1, 3])
    with pytest.raises(ConfigError, match="at least as many microbatches as stages"):
        PipelinePlan.build(pipeline_stages(model, 2), pp=2, schedule="1F1B", n_microbatches=1)


def test_embedding_and_output_count_as_layers_of_an_even_split():
    one_each = split_layers(LAYERS, 8, embedding_layers=1, output_layers=1)
    assert one_each == [[], *([name] for name in LAYERS), []]
    thirty_two = [f"layers.{i}" for i in range(32)]  # 34 units over 8 stages: 5, 5, then 4s; less 1 first and last
    sizes = [len(s) for s in split_layers(thirty_two, 8, embedding_layers=1, output_layers=1)]
    assert sizes == [4, 5, 4, 4, 4, 4, 4, 3]
    assert [len(s) for s in split_layers(LAYERS, 2, embedding_layers=2, output_layers=1)] == [3, 3]  # 9: 5 - 2, 4 - 1
    assert [len(s) for s in split_layers(LAYERS, 3, embedding_layers=2)] == [1, 3, 2]  # 8: 3 - 2, 3, 2
    assert split_layers(LAYERS, 4) == split_layers(LAYERS, 4, embedding_layers=0, output_layers=0)


def test_llama3_405b_split_of_meta_leaves_the_embedding_and_the_output_alone():
    """Meta's 405B pipeline (the Llama 3 paper, section 3.3.2): 126 blocks + the embedding + the output as 128
    one-unit stages over 16 ranks x 8 virtual stages; ranks 0 and 15 hold 7 blocks, the others 8."""
    stages = LLAMA3.pipeline_stages(LLAMA3_FLAVORS["405B"], 128, embedding_layers=1, output_layers=1)
    assert (stages[0], stages[1], stages[-1]) == (["tok_embeddings"], ["layers.0"], ["norm", "output"])
    blocks_per_rank = [
        sum(name.startswith("layers.") for stage in get_schedule("Interleaved1F1B").stage_ids(rank, 16, 8)
            for name in stages[stage])
        for rank in range(16)
    ]  # fmt: skip
    assert blocks_per_rank == [7, *[8] * 14, 7]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"num_stages": 9, "embedding_layers": 1, "output_layers": 1},
            r"give \[0, 1, 1, 1, 1, 1, 1, 1, -1\] blocks: only the first stage \(the embedding\) and the last",
        ),
        (
            {"num_stages": 4, "embedding_layers": 5},
            r"give \[-2, 3, 3, 2\] blocks",
        ),
        (  # 3 units over 5 stages: a middle stage without a block, none short of one
            {"layer_names": LAYERS[:2], "num_stages": 5, "embedding_layers": 1},
            r"give \[0, 1, 1, 0, 0\] blocks",
        ),
    ],
)
def test_embedding_and_output_layer_refusals(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        split_layers(**{"layer_names": LAYERS, **kwargs})


def test_split_points_with_layer_counts_are_refused_by_name():
    with pytest.raises(ConfigError, match=(
        "pipeline_parallel_split_points names each stage's first layer, so "
        "parallelism.pipeline_parallel_embedding_layers = 1 and parallelism.pipeline_parallel_output_layers = 0"
    )):  # fmt: skip
        plan(split_points=["layers.3"], embedding_layers=1)
    with pytest.raises(ValueError, match="must be 0 or more, and 0 with split points"):  # the Python API's misuse
        split_layers(LAYERS, 2, ["layers.3"], output_layers=1)
    with pytest.raises(ValueError, match="output_layers = -1 must be 0 or more"):
        split_layers(LAYERS, 2, output_layers=-1)


def test_negative_layer_counts_are_refused_by_name():
    from torchpre.config.job_config import JobConfig
    from torchpre.config.validate import check_section_bounds

    config = JobConfig()
    config.parallelism.pipeline_parallel_embedding_layers = -1
    with pytest.raises(ConfigError, match="parallelism.pipeline_parallel_embedding_layers = -1"):
        check_section_bounds(config)


def test_stages_holding_the_embedding_alone_and_the_output_alone_compose_to_the_full_model():
    args = LLAMA3_FLAVORS["tiny"]
    model = Transformer(args)
    model.init_weights(0)
    names = LLAMA3.pipeline_stages(args, 4, embedding_layers=1, output_layers=1)
    assert names == [["tok_embeddings"], ["layers.0"], ["layers.1"], ["norm", "output"]]
    stages = [prune_to(model, stage) for stage in names]
    assert list(stages[0].layers) == [] and list(stages[-1].layers) == []
    tokens = torch.randint(0, args.vocab_size, (2, 8))
    hidden = tokens
    for stage in stages:
        hidden = stage(hidden)
    torch.testing.assert_close(hidden, model(tokens), rtol=0, atol=0)
