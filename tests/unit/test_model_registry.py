"""`register_model`: a taken name is an error that names both places, except for the same spec object again or a
module imported a second time (the same line registering its new spec)."""

import dataclasses
import re
from pathlib import Path

import pytest

from torchpre.models import registry
from torchpre.models.args import ArgsDefaults
from torchpre.models.llama3.spec import SPEC as LLAMA3_SPEC
from torchpre.models.registry import get_model_spec, register_model
from torchpre.runtime.custom_import import import_custom_module

OTHER = dataclasses.replace(LLAMA3_SPEC, build=dataclasses.replace(LLAMA3_SPEC.build, blocks="layers2"))  # another spec


@pytest.fixture(autouse=True)
def scratch_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test registers into a copy of the registry (the built-in families included)."""
    get_model_spec("llama3")
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_REGISTERED_AT", dict(registry._REGISTERED_AT))


def test_a_taken_name_is_an_error_naming_both_places() -> None:
    register_model("mine", LLAMA3_SPEC)
    first_line = _line_of('register_model("mine", LLAMA3_SPEC)')
    with pytest.raises(ValueError) as error:
        register_model("mine", OTHER)
    message = str(error.value)
    again_line = _line_of('register_model("mine", OTHER)')
    assert f"at {__file__}:{again_line}: " in message and f"registered at {__file__}:{first_line}." in message
    assert "'mine' is taken" in message and "another name" in message
    assert get_model_spec("mine") is LLAMA3_SPEC  # the first registration stands


def test_a_flavor_whose_args_lack_the_model_args_protocol_is_refused() -> None:
    """Args that do not declare what torchpre reads of them (`ModelArgs`) are refused where they are registered, naming
    the flavor and the base class that declares the optional features; derived from it, they register."""

    @dataclasses.dataclass(frozen=True)
    class Bare:
        dim: int = 8
        n_layers: int = 1
        vocab_size: int = 16
        max_seq_len: int = 8

    @dataclasses.dataclass(frozen=True)
    class Declared(ArgsDefaults, Bare):
        pass

    with pytest.raises(TypeError) as error:
        register_model("bare", dataclasses.replace(LLAMA3_SPEC, flavors={"small": Bare()}))
    message = str(error.value)
    assert "flavor 'small' (Bare)" in message and "torchpre.models.args.ArgsDefaults" in message
    assert "bare" not in registry._REGISTRY
    register_model("declared", dataclasses.replace(LLAMA3_SPEC, flavors={"small": Declared()}))
    assert get_model_spec("declared").flavors["small"].mtp_depth == 0


def test_a_built_in_name_is_taken() -> None:
    with pytest.raises(ValueError, match=r"'llama3' is taken, registered at .*torchpre/models/families\.py"):
        register_model("llama3", OTHER)


def test_the_same_spec_again_is_allowed() -> None:
    register_model("mine", LLAMA3_SPEC)
    register_model("mine", LLAMA3_SPEC)
    assert get_model_spec("mine") is LLAMA3_SPEC


def test_a_module_imported_again_registers_its_new_spec(tmp_path: Path) -> None:
    """`job.custom_import` of a file runs it again: a new spec object from the same line replaces the old one."""
    module = tmp_path / "user_model.py"
    module.write_text(
        "import dataclasses\n"
        "from torchpre.models.llama3.spec import SPEC\n"
        "from torchpre.models.registry import register_model\n"
        "register_model('from-file', dataclasses.replace(SPEC))\n"
    )
    import_custom_module(str(module))
    first = get_model_spec("from-file")
    import_custom_module(str(module))
    assert get_model_spec("from-file") is not first
    assert get_model_spec("from-file") == first


def _line_of(code: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, line in enumerate(lines, start=1) if re.search(re.escape(code) + "$", line))
