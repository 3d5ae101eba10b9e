"""training.gc_freq: Python's collector is off while training and collects at the same steps on every rank."""

import gc

import pytest

from torchpre.runtime import garbage_collection
from torchpre.runtime.garbage_collection import GarbageCollection


@pytest.fixture
def collections(monkeypatch) -> list[int]:
    """The generation of every collection `GarbageCollection` makes, in order."""
    made: list[int] = []
    monkeypatch.setattr(garbage_collection.gc, "collect", lambda generation=2: made.append(generation) or 0)
    return made


@pytest.fixture(autouse=True)
def restore_gc():
    enabled = gc.isenabled()
    yield
    (gc.enable if enabled else gc.disable)()


def collected_at(garbage: GarbageCollection, steps: range, collections: list[int]) -> list[int]:
    """The steps of `steps` after which `garbage` collected."""
    at = []
    for step in steps:
        before = len(collections)
        garbage.step(step)
        if len(collections) > before:
            at.append(step)
    return at


def test_collects_generation_1_at_start_and_at_every_multiple_of_the_frequency(collections):
    with GarbageCollection(freq=3) as garbage:
        assert collections == [1]  # start-up's garbage, before the first step
        assert collected_at(garbage, range(1, 11), collections) == [3, 6, 9]  # global steps: the same on every rank
    assert collections == [1, 1, 1, 1]


def test_a_resumed_run_keeps_the_schedule_of_global_steps(collections):
    with GarbageCollection(freq=50) as garbage:
        assert collected_at(garbage, range(121, 201), collections) == [150, 200]


def test_automatic_collection_is_off_inside_and_restored_after(collections):
    gc.enable()
    with GarbageCollection(freq=5):
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), GarbageCollection(freq=5):  # a failed step restores it too
        raise RuntimeError("step failed")
    assert gc.isenabled()
    gc.disable()  # a program that turned it off itself keeps it off
    with GarbageCollection(freq=5):
        pass
    assert not gc.isenabled()


def test_frequency_0_leaves_the_collector_alone(collections):
    gc.enable()
    with GarbageCollection(freq=0) as garbage:
        assert gc.isenabled()
        for step in range(1, 101):
            garbage.step(step)
    assert gc.isenabled() and collections == []
