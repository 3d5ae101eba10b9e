"""Tensor parallelism (+ sequence parallel, + loss parallel) against the single-process model.

Two gloo processes run every variant in one spawn (process start-up dominates the cost). Each
worker also builds the plain model from the same seed and compares, in fp32 on CPU, where TP
changes only the order of reductions: initial shards bitwise, the summed loss to 1e-5
relative, every gradient and the parameters after one AdamW step to 1e-5 absolute. It also
counts the collectives, since a plan can be right and still communicate twice as much.
"""

from __future__ import annotations

import dataclasses
import gc
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.testing._internal.distributed.fake_pg import FakeStore

from tests.launch import spawn
from torchpre.errors import ConfigError
from torchpre.models.init import local_part
from torchpre.models.llama3.args import LLAMA3_FLAVORS, TransformerArgs
from torchpre.models.llama3.model import Transformer
from torchpre.models.llama3.parallelize import (
    apply_llama3_tensor_parallel,
    validate_llama3_tensor_parallel,
)
from torchpre.parallel.chunked_output import ChunkedProjection, chunk_output_layer
from torchpre.parallel.tensor_parallel import (
    apply_tensor_parallel,
    loss_parallel_context,
    reduce_partial_gradients,
)
from torchpre.planner.activation_probe import probe_microbatch

pytestmark = pytest.mark.slow

ARGS = dataclasses.replace(LLAMA3_FLAVORS["tiny"], vocab_size=128)
SEED = 0
BATCH, SEQ = 2, 16
# Adam's first step is lr * g / (|g| + eps): it amplifies reduction-order noise in a near-zero
# gradient (~1e-9 here) by up to lr / eps, so eps = 1e-6 keeps that well under the tolerance.
# foreach=True fails on a parameter list that mixes DTensors and plain tensors (the norms
# without SP): "aten._foreach_mul_.Scalar got mixed torch.Tensor and DTensor".
ADAMW = dict(lr=1e-3, eps=1e-6, foreach=False)


class Variant(NamedTuple):
    name: str
    sequence_parallel: bool
    loss_parallel: bool
    tie_word_embeddings: bool = False
    chunk_size: int = 0  # training.loss_chunk_size: a ChunkedOutput, vocabulary-parallel chunk by chunk
    mlp: str = "swiglu"  # model.mlp: GELU's plan has no w3
    save_sequence_shard: bool = False  # parallelism.sequence_parallel_save_shard


# 12 tokens per chunk: 3 chunks of the 32 tokens, the last one short.
VARIANTS = [
    Variant("tp", sequence_parallel=False, loss_parallel=False),
    Variant("tp+sp", sequence_parallel=True, loss_parallel=False),
    Variant("tp+sp+loss_parallel", sequence_parallel=True, loss_parallel=True),
    Variant("tp+loss_parallel", sequence_parallel=False, loss_parallel=True),
    Variant("tp, tied", sequence_parallel=False, loss_parallel=False, tie_word_embeddings=True),
    Variant("tp+sp+loss_parallel, tied", sequence_parallel=True, loss_parallel=True, tie_word_embeddings=True),
    Variant("tp+sp, chunked", sequence_parallel=True, loss_parallel=False, chunk_size=12),
    Variant("tp, tied, chunked", sequence_parallel=False, loss_parallel=True, tie_word_embeddings=True, chunk_size=12),
    Variant("tp+sp, gelu", sequence_parallel=True, loss_parallel=False, mlp="gelu"),
    Variant("tp+loss_parallel, gelu_tanh", sequence_parallel=False, loss_parallel=True, mlp="gelu_tanh"),
    Variant("tp+sp, saving the shard", sequence_parallel=True, loss_parallel=False, save_sequence_shard=True),
]


def test_tensor_parallel_matches_single_process(tmp_path: Path) -> None:
    spawn(_check_all_variants, world_size=2, store_path=tmp_path / "store")


def _check_all_variants(mesh: DeviceMesh) -> None:
    for variant in VARIANTS:
        _check_variant(variant, mesh)
    _check_saving_the_shard_changes_no_bit(mesh)
    _check_saving_the_shard_saves_memory(mesh)


def _check_variant(variant: Variant, mesh: DeviceMesh) -> None:
    args = dataclasses.replace(ARGS, tie_word_embeddings=variant.tie_word_embeddings, mlp=variant.mlp)
    reference = _materialize(_meta_model(args))
    model = _meta_model(args)
    if variant.chunk_size:
        chunk_output_layer(model, "output", variant.chunk_size)
    apply_llama3_tensor_parallel(
        model, mesh, sequence_parallel=variant.sequence_parallel, loss_parallel=variant.loss_parallel,
        save_sequence_shard=variant.save_sequence_shard,
    )
    tied = model.output.weight is model.tok_embeddings.weight
    assert tied == variant.tie_word_embeddings, variant.name
    _materialize(model)
    expected = dict(reference.named_parameters())

    for name, param in model.named_parameters():
        assert _placements(param) == _expected_placements(name, variant.sequence_parallel), (variant.name, name)
        local = param.to_local() if isinstance(param, DTensor) else param
        assert torch.equal(local, local_part(expected[name], param)), f"{variant.name}: initial {name}"

    tokens, labels = _batch()
    reference_loss = _loss(reference(tokens), labels)
    reference_loss.backward()
    with loss_parallel_context(variant.loss_parallel), CommDebugMode() as comms:
        output = model(tokens)
        chunked = variant.chunk_size > 0
        loss = ChunkedProjection(model).cross_entropy_sum(output, labels) if chunked else _loss(output, labels)
        loss.backward()
    if chunked:  # the hidden states, every rank's whole sequence
        assert output.placements == (Replicate(),) and output.shape == (BATCH, SEQ, ARGS.dim), variant.name
    elif not variant.loss_parallel:
        assert type(output) is Tensor and output.shape == (BATCH, SEQ, ARGS.vocab_size), variant.name
    torch.testing.assert_close(_full(loss.detach()), reference_loss.detach(), rtol=1e-5, atol=0)
    assert comms.get_comm_counts() == _expected_collectives(variant), variant.name

    # The embedding's gradient comes back Replicate, the norms' under SP Partial: align them.
    reduce_partial_gradients(model.parameters(), mesh.get_group())
    for name, param in model.named_parameters():
        assert _placements(param.grad) == _placements(param), (variant.name, name)
        _assert_close(_full(param.grad), expected[name].grad, f"{variant.name}: gradient of {name}")

    torch.optim.AdamW(model.parameters(), **ADAMW).step()
    torch.optim.AdamW(reference.parameters(), **ADAMW).step()
    for name, param in model.named_parameters():
        _assert_close(_full(param.detach()), expected[name].detach(), f"{variant.name}: {name} after a step")


def _sequence_parallel_model(save_sequence_shard: bool, mesh: DeviceMesh) -> Transformer:
    model = _meta_model()
    apply_llama3_tensor_parallel(
        model, mesh, sequence_parallel=True, loss_parallel=False, save_sequence_shard=save_sequence_shard
    )
    return _materialize(model)


def _check_saving_the_shard_changes_no_bit(mesh: DeviceMesh) -> None:
    """parallelism.sequence_parallel_save_shard gathers the same shard again: the same loss and gradients, bit for
    bit, as saving the gathered input."""
    tokens, labels = _batch()
    grads = []
    for save in (False, True):
        model = _sequence_parallel_model(save, mesh)
        loss = _loss(model(tokens), labels)
        loss.backward()
        grads.append((loss.detach(), {name: _full(p.grad) for name, p in model.named_parameters()}))
    (loss, saved), (loss_saving, saved_saving) = grads
    assert torch.equal(loss, loss_saving)
    assert saved.keys() == saved_saving.keys()
    for name, grad in saved.items():
        assert torch.equal(grad, saved_saving[name]), f"gradient of {name} differs when saving the shard"


def _check_saving_the_shard_saves_memory(mesh: DeviceMesh) -> None:
    """The planner's probe of one forward and backward: each attention and feed-forward keeps its input's shard
    instead of the gathered input (tp - 1 shards less each) and gathers it once more in backward."""
    tokens, labels = _batch()
    probes = []
    for save in (False, True):
        model = _sequence_parallel_model(save, mesh)
        gc.collect()
        gc.disable()  # a collection during the probe would free earlier cyclic garbage at a moment of its choosing
        try:
            probes.append(probe_microbatch(model, (tokens,), loss_fn=lambda out: _loss(out, labels)))
        finally:
            gc.enable()
    gathered = BATCH * SEQ * ARGS.dim * 4  # one module's fp32 input, whole sequence
    shard = gathered // mesh.size()
    saved = [probe.saved_bytes for probe in probes]
    assert saved[0] - saved[1] == 2 * ARGS.n_layers * (gathered - shard), saved
    gathers = [sum(c.op.endswith("all_gather_into_tensor") for c in probe.collectives) for probe in probes]
    assert gathers[1] - gathers[0] == 2 * ARGS.n_layers


def _meta_model(args: TransformerArgs = ARGS) -> Transformer:
    with torch.device("meta"):
        return Transformer(args)


def _materialize(model: Transformer) -> Transformer:
    model.to_empty(device="cpu")
    model.init_weights(SEED)
    return model


def _expected_placements(name: str, sequence_parallel: bool) -> tuple[Placement, ...] | None:
    """What the docstring of torchpre/models/llama3/parallelize.py promises; None = plain."""
    if name.endswith("norm.weight"):
        return (Replicate(),) if sequence_parallel else None
    if name.endswith(("wo.weight", "w2.weight")):
        return (Shard(1),)
    return (Shard(0),)


def _expected_collectives(variant: Variant) -> dict[object, int]:
    """Collectives of one forward, loss and backward: what the plan costs in communication.

    The 2 * n_layers + 1 row-parallel outputs (embedding, wo, w2) are reduced in the forward and
    the 2 * n_layers + 1 replicated inputs (attention, feed_forward, output) get their gradient
    reduced in the backward: an all-reduce each, or under SP a reduce-scatter each, paired with
    the all-gather that is the other direction's transpose. Then the logits are all-gathered,
    or loss parallel all-reduces three times (max and sum of exponentials for log-softmax, the
    target logits for NLL); the chunked loss all-reduces twice per chunk (the maximum; the sum
    of exponentials with the label logits), whether or not loss parallel is on. Saving the sequence
    shard adds an all-gather per attention and feed-forward in backward.
    """
    ops = torch.ops.c10d_functional
    crossings = 2 * (2 * ARGS.n_layers + 1)
    counts: Counter[object] = Counter()
    if variant.sequence_parallel:
        counts.update({ops.reduce_scatter_tensor: crossings, ops.all_gather_into_tensor: crossings})
    else:
        counts[ops.all_reduce] += crossings
    if variant.save_sequence_shard:  # attention and feed-forward gather their input again in backward
        counts[ops.all_gather_into_tensor] += 2 * ARGS.n_layers
    if variant.chunk_size:
        counts[torch.ops.c10d.allreduce_] += 2 * -(-BATCH * SEQ // variant.chunk_size)
    elif variant.loss_parallel:
        counts[ops.all_reduce] += 3
    else:
        counts[ops.all_gather_into_tensor] += 1
    return dict(counts)


def _placements(tensor: Tensor) -> tuple[Placement, ...] | None:
    return tensor.placements if isinstance(tensor, DTensor) else None


def _batch() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ), generator=generator)
    return tokens, labels


def _loss(logits: Tensor, labels: Tensor) -> Tensor:
    """The trainer's loss: summed token cross-entropy in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")


def _full(tensor: Tensor) -> Tensor:
    """Collective for a DTensor: every rank must call it."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _assert_close(actual: Tensor, expected: Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5, msg=lambda message: f"{what}\n{message}")


# Process launching -------------------------------------------------------------------------


# Single process ----------------------------------------------------------------------------


@pytest.fixture
def one_rank_mesh() -> Iterator[DeviceMesh]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("key", "missing", "closest"),
    [
        ("layers.*.attention.wqq", "layers.0.attention.wqq", "layers.0.attention.wq"),
        ("layers.7.feed_forward", "layers.7.feed_forward", "layers.0.feed_forward"),
        ("outptu", "outptu", "output"),
    ],
)
def test_plan_naming_a_missing_module_is_a_config_error(
    one_rank_mesh: DeviceMesh, key: str, missing: str, closest: str
) -> None:
    with pytest.raises(ConfigError, match=rf"'{key}'.*'{missing}' is not a submodule.*{closest}"):
        apply_tensor_parallel(_meta_model(), one_rank_mesh, {key: ColwiseParallel()})


@pytest.fixture
def fake_tp2_mesh() -> Iterator[DeviceMesh]:
    """Rank 0 of two under torch's fake process group: the plan is really applied (on the meta device)."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("absent", [("tok_embeddings",), ("norm", "output")])
def test_plan_covers_only_what_a_pipeline_stage_holds(fake_tp2_mesh: DeviceMesh, absent: tuple[str, ...]) -> None:
    """A first or last pipeline stage (one block, no head or no embedding) gets the plan of what it holds: no
    error for the parts it lacks, and every part it has laid out as in the whole model."""
    stage = _meta_model()
    for part in absent:
        setattr(stage, part, None)
    del stage.layers["1"]
    apply_llama3_tensor_parallel(stage, fake_tp2_mesh, sequence_parallel=True, loss_parallel=True)
    expected = {
        "tok_embeddings.weight": Shard(0),
        "layers.0.attention.wq.weight": Shard(0),
        "layers.0.attention.wo.weight": Shard(1),
        "layers.0.feed_forward.w2.weight": Shard(1),
        "layers.0.attention_norm.weight": Replicate(),
        "norm.weight": Replicate(),
        "output.weight": Shard(0),
    }
    plain = [name for name, param in stage.named_parameters() if not isinstance(param, DTensor)]
    assert not plain, f"not sharded by the plan: {plain}"
    placements = {name: param.placements for name, param in stage.named_parameters()}
    held = {name: (placement,) for name, placement in expected.items() if name.split(".")[0] not in absent}
    assert {name: placements[name] for name in held} == held
    assert not any(name.startswith(absent) for name in placements)


def test_one_rank_mesh_leaves_the_model_plain(one_rank_mesh: DeviceMesh) -> None:
    model = _meta_model()
    apply_llama3_tensor_parallel(model, one_rank_mesh, sequence_parallel=True, loss_parallel=True)
    assert not any(isinstance(param, DTensor) for param in model.parameters())


def test_head_counts_must_be_divisible_by_the_tensor_parallel_degree() -> None:
    validate_llama3_tensor_parallel(ARGS, 2)  # n_heads = 4, n_kv_heads = 2
    with pytest.raises(ConfigError) as error:
        validate_llama3_tensor_parallel(ARGS, 4)
    message = str(error.value)
    assert "n_kv_heads = 2 is not divisible by parallelism.tensor_parallel_degree = 4" in message
    assert "divisor of both n_heads = 4 and n_kv_heads = 2 (1, 2)" in message
    with pytest.raises(ConfigError, match=r"n_heads = 4 is not divisible by parallelism.tensor_parallel_degree = 3"):
        validate_llama3_tensor_parallel(ARGS, 3)
