"""The checkpoint manager over toy components: it saves a mapping of `Stateful` entries and loads each through its
`state_dict` / `load_targets` / `load_state_dict`, knowing nothing of what they hold; entries a checkpoint of an
older format keeps elsewhere, weights-only loads and `exclude_from_loading` work on any component."""

import dataclasses

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.launch import add_manifest
from tests.unit.test_checkpoint_integrity import _components, _manager
from torchpre.errors import TorchpreError


class OptionalCounter:
    """A component whose entry older checkpoints lack: it loads what is there and keeps its value otherwise."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_targets(self, saved: set[str]) -> dict[str, int]:
        return self.state_dict() if "counter.value" in saved else {}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.value = int(state_dict["value"])


def test_every_component_comes_back_and_a_missing_optional_one_keeps_its_state(world, tmp_path):
    saving = _components(step=4, consumed=16) | {"counter": OptionalCounter(7)}
    with torch.no_grad():
        saving["model"].tensors["weight"].fill_(0.25)
    _manager(tmp_path, components=saving).save(4)
    loading = _components() | {"counter": OptionalCounter()}
    manager = _manager(tmp_path, components=loading)
    assert manager.load(tmp_path / "step-4") == ["model", "optimizer", "lr_scheduler", "dataloader", "train", "counter"]
    assert torch.equal(loading["model"].tensors["weight"], torch.full((4, 4), 0.25))
    assert (loading["train"].values, loading["dataloader"].values, loading["counter"].value) == (
        {"step": 4}, {"consumed_samples": 16}, 7,
    )

    older = _components(step=2)  # a checkpoint written before the counter existed
    _manager(tmp_path / "older", components=older).save(2)
    loading = _components() | {"counter": OptionalCounter(5)}
    assert "counter" not in _manager(tmp_path / "older", components=loading).load(tmp_path / "older" / "step-2")
    assert loading["counter"].value == 5


def test_a_required_entry_the_checkpoint_lacks_is_an_error_naming_it(world, tmp_path):
    saving = _components(step=2)
    del saving["lr_scheduler"]
    _manager(tmp_path, components=saving).save(2)
    with pytest.raises(TorchpreError, match=r"lacks \d+ entries this job loads: lr_scheduler\."):
        _manager(tmp_path).load(tmp_path / "step-2")


def test_the_data_position_of_an_older_format_loads_from_its_old_place(world, tmp_path):
    """Main at 0a62600 kept the data position as train.consumed_samples; it loads into the data component."""
    components = _components(step=3)
    state = {key: component.state_dict() for key, component in components.items() if key != "dataloader"}
    state["train"]["consumed_samples"] = 24
    folder = tmp_path / "step-3"
    dcp.save(state, checkpoint_id=str(folder))
    add_manifest(folder)
    loading = _components()
    _manager(tmp_path, components=loading).load(folder)
    assert loading["dataloader"].values == {"consumed_samples": 24}
    assert loading["train"].values == {"step": 3}


def test_weights_only_and_excluded_entries_are_left_as_they_are(world, tmp_path):
    _manager(tmp_path, components=_components(step=6, consumed=30)).save(6)
    loading = _components()
    assert _manager(tmp_path, components=loading).load(tmp_path / "step-6", weights_only=True) == ["model"]
    assert loading["train"].values == {"step": 0} and loading["dataloader"].loaded == []
    manager = _manager(tmp_path, components=loading)
    manager.settings = dataclasses.replace(manager.settings, exclude_from_loading=["dataloader", "optimizer"])
    assert manager.load(tmp_path / "step-6") == ["model", "lr_scheduler", "train"]
    assert loading["dataloader"].loaded == [] and loading["train"].values == {"step": 6}
