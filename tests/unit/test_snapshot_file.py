"""In-memory snapshots, the pieces without processes: the file format and its checks (snapshots/file_format.py),
the choice of the step every rank resumes from (snapshots/restore.py's `choose`), the peers that keep the replicas
(snapshots/peers.py) and the config keys."""

import dataclasses
from pathlib import Path

import pytest
import torch

from torchpre.checkpoint.snapshots.file_format import (
    Digest,
    Expected,
    SnapshotError,
    encode_prefix,
    entries_of,
    parse_name,
    snapshot_name,
    tensor_at,
    verify,
)
from torchpre.checkpoint.snapshots.peers import peer_ranks, same_node_peers
from torchpre.checkpoint.snapshots.restore import Listing, choose
from torchpre.config.job_config import JobConfig
from torchpre.config.validate import validate_config
from torchpre.errors import ConfigError

LAYOUT = {"world_size": 2, "dp": 2, "tp": 1, "pp": 1, "ep": 1, "cp": 1}
PATH = Path("/dev/shm/torchpre/run/rank1-step7.own")


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "model.w": torch.randn(3, 5, generator=generator),
        "model.b": torch.randn(7, generator=generator).to(torch.bfloat16),
        "optimizer.step": torch.tensor(7.0),
        "rng.rank1": torch.randint(0, 255, (13,), dtype=torch.uint8, generator=generator),
    }


def _snapshot(tensors: dict, expected: Expected, values: dict | None = None) -> bytearray:
    """A snapshot file's bytes, as SnapshotManager writes them."""
    payload = torch.zeros(expected.payload_bytes, dtype=torch.uint8)
    for entry, tensor in zip(expected.entries, tensors.values()):
        tensor_at(memoryview(payload.numpy()), entry).copy_(tensor)
    prefix = encode_prefix(expected, values if values is not None else {"train.step": expected.step})
    digest = Digest(expected.signing_key)
    digest.update(prefix)
    digest.update(payload.numpy().tobytes())
    return bytearray(prefix + payload.numpy().tobytes() + digest.value())


def _expected(tensors: dict, **changes) -> Expected:
    return dataclasses.replace(Expected("run-a", 7, 1, 2, LAYOUT, entries_of(tensors)), **changes)


def test_a_snapshot_reads_back_bitwise_with_its_values_and_aligned_tensors():
    tensors = _tensors()
    expected = _expected(tensors)
    values = {"train.step": 7, "lr_scheduler.last_epoch": 7, "dataloader.consumed_samples": 56}
    data = _snapshot(tensors, expected, values)
    read, payload = verify(data, expected, PATH)
    assert read == values
    assert (len(data) - len(payload) - 4) % 64 == 0  # the payload starts aligned
    for entry, tensor in zip(expected.entries, tensors.values()):
        assert entry[3] % 64 == 0
        loaded = tensor_at(payload, entry)
        assert loaded.dtype == tensor.dtype
        assert torch.equal(loaded.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("cut", [1, 100, 0.5])
def test_a_torn_snapshot_is_refused(cut):
    tensors = _tensors()
    expected = _expected(tensors)
    data = _snapshot(tensors, expected)
    kept = int(len(data) * cut) if isinstance(cut, float) else len(data) - cut
    with pytest.raises(SnapshotError, match="torn or altered|no torchpre snapshot"):
        verify(data[:kept], expected, PATH)


def test_an_altered_byte_is_refused():
    tensors = _tensors()
    expected = _expected(tensors)
    data = _snapshot(tensors, expected)
    data[-40] ^= 1
    with pytest.raises(SnapshotError, match="crc32 does not match its bytes"):
        verify(data, expected, PATH)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("run", "run-b", "its run is 'run-b'"),
        ("step", 6, "its step is 6"),
        ("rank", 0, "its rank is 0"),
        ("world_size", 4, "its world_size is 4"),
        ("layout", {**LAYOUT, "dp": 1, "tp": 2}, "its layout is"),
    ],
)
def test_another_runs_steps_ranks_or_layouts_snapshot_is_refused(field, value, message):
    """Written for `field` = `value`, read by this rank of this run: never used, whatever its digest."""
    tensors = _tensors()
    data = _snapshot(tensors, _expected(tensors, **{field: value}))
    with pytest.raises(SnapshotError, match=message):
        verify(data, _expected(tensors), PATH)


def test_a_snapshot_of_other_tensors_is_refused():
    tensors = _tensors()
    other = {**tensors, "model.w": torch.zeros(5, 3)}
    data = _snapshot(other, _expected(other))
    with pytest.raises(SnapshotError, match="its tensors are not those this rank holds"):
        verify(data, _expected(tensors), PATH)


def test_a_value_against_its_rule_or_another_step_is_refused():
    tensors = _tensors()
    expected = _expected(tensors)
    with pytest.raises(SnapshotError, match="'train.step' is not the snapshot's step 7"):
        verify(_snapshot(tensors, expected, {"train.step": 6}), expected, PATH)
    with pytest.raises(SnapshotError, match="dataloader.consumed_samples"):
        verify(_snapshot(tensors, expected, {"train.step": 7, "dataloader.consumed_samples": -1}), expected, PATH)


def test_under_a_signing_key_only_a_snapshot_signed_with_it_is_used():
    tensors = _tensors()
    signed = _expected(tensors, signing_key=b"k" * 32)
    assert verify(_snapshot(tensors, signed), signed, PATH)[0] == {"train.step": 7}
    with pytest.raises(SnapshotError, match="hmac-sha256 does not match"):
        verify(_snapshot(tensors, _expected(tensors, signing_key=b"x" * 32)), signed, PATH)
    with pytest.raises(SnapshotError):  # a CRC-32 one, as anyone can write
        verify(_snapshot(tensors, _expected(tensors)), signed, PATH)


def test_file_names_say_rank_and_step_and_nothing_else_parses():
    assert parse_name(snapshot_name(3, 120, "own")) == (3, 120)
    assert parse_name(snapshot_name(3, 120, "replica")) == (3, 120)
    for name in (".tmp-rank3-step120.own", "rank3-step120.own.x", "rank-1-step2.own", "rank3-step120"):
        assert parse_name(name) is None


def _listing(rank: int, files: dict[int, list[int]], disk_step: int = 0, replica: bool = False) -> Listing:
    kind = "replica" if replica else "own"
    held = tuple((r, s, snapshot_name(r, s, kind)) for r, steps in files.items() for s in steps)
    return Listing(rank, f"node{rank}:/dev/shm", held, 1 << 20, disk_step)


def test_the_step_chosen_is_the_newest_complete_for_every_rank():
    listings = [_listing(0, {0: [3, 4]}), _listing(1, {1: [3]})]
    step, plan = choose(listings, set())
    assert step == 3
    assert plan == {0: (0, "rank0-step3.own"), 1: (1, "rank1-step3.own")}


def test_a_rank_whose_folder_was_emptied_reads_its_peers_replica():
    listings = [
        Listing(0, "node0:/dev/shm", (*_listing(0, {0: [5, 6]}).files, *_listing(0, {1: [5, 6]}, replica=True).files),
                1 << 20, 0),
        _listing(1, {}),
    ]  # fmt: skip
    step, plan = choose(listings, set())
    assert step == 6 and plan[1] == (0, "rank1-step6.replica") and plan[0] == (0, "rank0-step6.own")


def test_no_step_newer_than_the_disk_checkpoint_means_the_disk_for_everyone():
    assert choose([_listing(0, {0: [3, 4]}, disk_step=4), _listing(1, {1: [3, 4]})], set()) is None
    assert choose([_listing(0, {0: [4]}), _listing(1, {1: [3]})], set()) is None


def test_a_refused_file_moves_the_choice_to_a_replica_then_to_an_older_step():
    listings = [
        Listing(0, "node0:/dev/shm", (*_listing(0, {0: [7, 8]}).files, *_listing(0, {1: [7, 8]}, replica=True).files),
                1 << 20, 0),
        Listing(1, "node1:/dev/shm", (*_listing(1, {1: [7, 8]}).files, *_listing(1, {0: [7, 8]}, replica=True).files),
                1 << 20, 0),
    ]  # fmt: skip
    refused = {(0, 8, 0, "rank0-step8.own")}
    assert choose(listings, refused) == (8, {0: (1, "rank0-step8.replica"), 1: (1, "rank1-step8.own")})
    refused.add((0, 8, 1, "rank0-step8.replica"))
    assert choose(listings, refused)[0] == 7


def test_peers_are_on_another_node_at_the_same_local_index():
    nodes = ["a/0", "a/0", "b/1", "b/1"]
    assert peer_ranks(nodes) == [2, 3, 0, 1]
    assert same_node_peers(nodes, peer_ranks(nodes)) == []
    interleaved = ["a", "b", "a", "b"]  # ranks not numbered node by node
    peers = peer_ranks(interleaved)
    assert sorted(peers) == [0, 1, 2, 3] and all(interleaved[peers[r]] != interleaved[r] for r in range(4))


def test_on_one_node_the_peer_is_the_next_rank_and_unequal_nodes_are_named():
    assert peer_ranks(["a"] * 4) == [1, 2, 3, 0]
    nodes = ["a", "a", "a", "b", "b"]
    peers = peer_ranks(nodes)
    assert sorted(peers) == list(range(5))
    assert same_node_peers(nodes, peers) == [r for r in range(5) if nodes[peers[r]] == nodes[r]] != []


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"memory_interval": -1}, "checkpoint.memory_interval = -1: it must be at least 0"),
        ({"memory_interval": 1, "memory_replicas": 2}, "checkpoint.memory_replicas = 2: it must be 0"),
        ({"memory_interval": 1, "enable": False}, "but checkpoint.enable is off"),
        ({"memory_interval": 1, "model_only": True}, "checkpoint.model_only saves the weights alone"),
        ({"memory_interval": 1, "memory_folder": ""}, "checkpoint.memory_folder is empty"),
    ],
)
def test_memory_keys_are_checked(tmp_path, changes, message):
    config = JobConfig()
    config.job.dump_folder = str(tmp_path)
    config.checkpoint.enable = True
    for key, value in changes.items():
        setattr(config.checkpoint, key, value)
    with pytest.raises(ConfigError, match=message):
        validate_config(config)
