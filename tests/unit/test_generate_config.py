"""Generation's flags are `GenerateConfig`, parsed by the training config parser: --help, type errors, bools
and did-you-mean work as they do for train.py, and the generation model is built by the trainer's code."""

import dataclasses

import pytest

from torchpre.config.parser import parse_args
from torchpre.errors import ConfigError
from torchpre.generate import GenerateConfig, decoding_config, main
from torchpre.models import registry
from torchpre.models.llama3.spec import SPEC as LLAMA3
from torchpre.models.registry import get_model_spec
from torchpre.runtime.cli import run_entry_point

PROMPT = ["--model.flavor", "tiny", "--prompt", "hello"]


def test_help_lists_the_generation_flags_with_their_help_then_the_job_options(capsys):
    run_entry_point(main, ["--help"], prog="python -m torchpre.generate")  # prints the help and returns
    text = capsys.readouterr().out
    assert text.startswith("usage: python -m torchpre.generate")
    lines = {line.split()[0]: " ".join(line.split()) for line in text.splitlines() if line.startswith("  --")}
    for field in dataclasses.fields(GenerateConfig):
        if "help" in field.metadata:  # the generation flags, not the job sections
            assert f"--{field.name}" in lines and lines[f"--{field.name}"].endswith(field.metadata["help"]), field
    assert lines["--temperature"] == "--temperature float (default: 0.8) softmax temperature; 0 = greedy"
    assert lines["--top_k"].startswith("--top_k int | None (default: none)")
    assert lines["--json"].startswith("--json bool (default: false)")
    assert text.index("--prompt") < text.index("[job]") < text.index("--checkpoint.folder")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--temprature", "0"], "Unknown option '--temprature' on the command line; did you mean '--temperature'?"),
        (["--max_new_token", "3"], "did you mean '--max_new_tokens'?"),
        (["--temperature", "hot"], "Invalid value 'hot' for 'temperature' on the command line: expected float."),
        (["--top_k", "1.5"], "Invalid value '1.5' for 'top_k' on the command line: expected int | None."),
        (["--json=maybe"], "Invalid value 'maybe' for 'json' on the command line: expected bool"),
        (["--max_new_tokens"], "Option '--max_new_tokens' on the command line needs a value (int)."),
    ],
)
def test_bad_flags_get_the_config_parsers_messages(argv, message):
    with pytest.raises(ConfigError) as error:
        main([*PROMPT, *argv])
    assert message in str(error.value)


def test_flags_parse_like_training_options(tmp_path):
    config = parse_args(GenerateConfig, [*PROMPT, "--json", "--top_k", "none", "--temperature", "0", "--seed", "3"])
    assert (config.prompt, config.json, config.top_k, config.temperature, config.seed) == ("hello", True, None, 0.0, 3)
    assert parse_args(GenerateConfig, [*PROMPT, "--json=no", "--top_k=5"]).json is False
    assert parse_args(GenerateConfig, PROMPT).max_new_tokens == 32
    # The job's TOML file holds the job's options; the generation flags stay on the command line.
    toml = tmp_path / "job.toml"
    toml.write_text('[model]\nflavor = "tiny"\n[training]\nmixed_precision_param = "bfloat16"\n')
    config = parse_args(GenerateConfig, ["--job.config_file", str(toml), "--prompt", "x"])
    assert (config.model.flavor, config.training.mixed_precision_param, config.prompt) == ("tiny", "bfloat16", "x")


def test_decoding_turns_off_only_the_training_options():
    config = parse_args(
        GenerateConfig,
        [
            *PROMPT, "--parallelism.enable_sequence_parallel", "--parallelism.enable_loss_parallel",
            "--activation_checkpoint.mode", "full", "--compile.enable", "--parallelism.tensor_parallel_degree", "2",
        ],
    )
    decoding = decoding_config(config)
    assert not decoding.parallelism.enable_sequence_parallel and not decoding.parallelism.enable_loss_parallel
    assert decoding.activation_checkpoint.mode == "none" and not decoding.compile.enable
    assert decoding.parallelism.tensor_parallel_degree == 2 and decoding.prompt == "hello"


def test_generation_rejects_a_layout_with_the_trainers_message(monkeypatch):
    """The layout checks are the trainer's (`torchpre.assembly.layout_checks.check_layout`), not a copy: a family
    without a tensor-parallel plan gets the trainer's message, naming the ModelSpec field, before any process group."""
    get_model_spec("llama3")  # registers the built-in families first
    no_tp = dataclasses.replace(LLAMA3, parallel=dataclasses.replace(LLAMA3.parallel, tensor_parallel=None))
    monkeypatch.setitem(registry._REGISTRY, "llama3-no-tp", no_tp)
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = [*PROMPT, "--model.name", "llama3-no-tp", "--parallelism.tensor_parallel_degree", "2"]
    with pytest.raises(ConfigError, match=r"has no tensor-parallel plan \(ModelSpec.parallel.tensor_parallel\)"):
        main(argv)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max_new_tokens", "0"], "--max_new_tokens = 0: it must be at least 1."),
        (["--top_k", "0"], "--top_k = 0: it must be at least 1 (or none for no top-k filtering)."),
        (["--temperature", "-1"], "--temperature = -1.0: use 0 for greedy decoding or a positive value."),
        (["--parallelism.data_parallel_shard_degree", "0"], "parallelism.data_parallel_shard_degree = 0: use -1"),
    ],
)
def test_generation_checks_the_bounds_declared_with_its_flags_and_the_job_s_keys(argv, message):
    with pytest.raises(ConfigError) as error:
        main([*PROMPT, *argv])
    assert str(error.value).startswith(message)
