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


def parallelism(schedule="1F1B", pp=2, microbatch_size=1, virtual_stages=1):
    return SimpleNamespace(
        pipeline_parallel_schedule=schedule,
        pipeline_parallel_degree=pp,
        pipeline_parallel_microbatch_size=microbatch_size,
        pipeline_parallel_virtual_stages=virtual_stages,
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
