"""The quantize section: which linears convert, what a checkpoint sees, the refusals (training: integration)."""

import dataclasses
import sys

import pytest
import torch

from torchpre.assembly.layout_checks import check_quantize
from torchpre.errors import ConfigError
from torchpre.models.llama3.args import LLAMA3_FLAVORS
from torchpre.models.llama3.model import Transformer
from torchpre.parallel.quantize import QuantizePlan, convert_linears, resolve_emulate

pytest.importorskip("torchao")


def tiny_model() -> Transformer:
    with torch.device("meta"):
        return Transformer(dataclasses.replace(LLAMA3_FLAVORS["tiny"], vocab_size=2048, max_seq_len=32))


@pytest.mark.parametrize("linear, recipe", [("float8", "tensorwise"), ("float8", "rowwise"), ("mxfp8", "rowwise")])
def test_block_linears_convert_and_the_state_dict_stays_high_precision(linear, recipe):
    """Every block linear converts, the output layer does not, and the state dict keeps its names, shapes and
    dtypes: a checkpoint does not know whether FP8 was on."""
    model, plain = tiny_model(), tiny_model()
    converted = convert_linears(model, QuantizePlan(linear, recipe, ("layers.*",), emulate=True))
    assert len(converted) == 7 * len(model.layers)  # wq wk wv wo w1 w2 w3
    assert type(model.output) is torch.nn.Linear
    shapes = lambda m: {k: (v.shape, v.dtype, type(v)) for k, v in m.state_dict().items()}  # noqa: E731
    assert shapes(model) == shapes(plain)


def test_the_output_layer_converts_when_a_pattern_names_it():
    model = tiny_model()
    converted = convert_linears(model, QuantizePlan("float8", "rowwise", ("layers.*.feed_forward.*", "output"), True))
    assert converted == [*(f"layers.{i}.feed_forward.w{j}" for i in range(len(model.layers)) for j in (1, 2, 3)),
                         "output"]  # fmt: skip


def test_linears_the_kernels_cannot_take_stay_in_high_precision():
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 40))
    assert convert_linears(model, QuantizePlan("float8", "rowwise", ("*",), True)) == ["0"]  # 40 % 16 != 0
    assert convert_linears(model, QuantizePlan("mxfp8", "rowwise", ("*",), True)) == []  # 48 % 32 != 0


def test_missing_torchao_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # what `import torchao` meets when it is not installed
    with pytest.raises(ConfigError, match=r"quantize.linear = 'float8'.*pip install torchpre\[fp8\]"):
        check_quantize("float8", "rowwise", 32, "training.seq_len")
    check_quantize("none", "rowwise", 32, "training.seq_len")  # off: torchao is not needed


def test_auto_emulates_on_cpu_and_false_is_refused_there():
    cpu = torch.device("cpu")
    assert resolve_emulate("float8", "auto", cpu) is True
    assert resolve_emulate("mxfp8", "true", cpu) is True
    with pytest.raises(ConfigError, match="compute capability 8.9"):
        resolve_emulate("float8", "false", cpu)
    assert resolve_emulate("float8", "false", torch.device("meta")) is False  # a dry run plans for a GPU


def test_by_default_the_linears_of_the_family_s_blocks_convert():
    from torchpre.assembly.plans import quantize_plan
    from torchpre.config.job_config import JobConfig

    config = JobConfig()
    config.quantize.linear = "float8"
    assert quantize_plan(config, torch.device("cpu"), "model.layers").modules == ("model.layers.*",)  # model.name hf
    config.quantize.modules = ["layers.*.attention.*"]
    assert quantize_plan(config, torch.device("cpu"), "layers").modules == ("layers.*.attention.*",)
