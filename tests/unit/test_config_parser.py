"""The generic config parser, exercised with toy dataclass configs (not the real JobConfig)."""

import dataclasses
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

from torchpre.config.parser import HelpRequested, format_help, parse_args, to_dict, to_toml
from torchpre.errors import ConfigError


def _opt(default, doc):
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": doc})
    return field(default=default, metadata={"help": doc})


@dataclass
class Job:
    config_file: str = _opt("", "TOML file to read")
    dump_folder: str = _opt("./outputs", "where outputs go")
    description: str | None = _opt(None, "free text")


@dataclass
class Training:
    steps: int = _opt(10, "optimizer steps")
    lr: float = _opt(3e-4, "peak learning rate")
    compile: bool = _opt(False, "torch.compile each block")
    seq_len: int | None = _opt(None, "tokens per sequence")
    max_norm: Optional[float] = _opt(None, "gradient clipping norm")
    async_save: bool | None = _opt(None, "save asynchronously")
    mode: Literal["none", "full", "selective"] = _opt("none", "activation checkpointing")
    dtype: Literal["none", "bfloat16"] | None = _opt(None, "a Literal that lists 'none'")
    precision: Literal["float32", "bfloat16"] | None = _opt(None, "an optional Literal")
    datasets: list[str] = _opt(["c4"], "dataset names")
    ranks: list[int] = _opt([], "ranks to profile")
    factors: list[float] = _opt([1.0], "some factors")
    weights: dict[str, float] = _opt({}, "dataset mixture weights")


@dataclass
class Toy:
    job: Job = field(default_factory=Job)
    training: Training = field(default_factory=Training)


@dataclass
class Attention:
    heads: int = _opt(8, "attention heads")


@dataclass
class Model:
    name: str = _opt("llama3", "model family")
    attention: Attention = field(default_factory=Attention)


@dataclass
class Nested:
    seed: int = _opt(0, "a top-level option")
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=lambda: Model(name="custom"))


@dataclass
class Section:
    steps: int = _opt(1, "steps")


@dataclass
class NoConfigFile:
    training: Section = field(default_factory=Section)


@dataclass
class Bad:
    values: dict[int, float] = field(default_factory=dict)


@dataclass
class BadConfig:
    bad: Bad = field(default_factory=Bad)


def _toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "config.toml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def _error(config_cls, argv) -> str:
    with pytest.raises(ConfigError) as info:
        parse_args(config_cls, argv)
    return str(info.value)


# ----- resolution ------------------------------------------------------------------------------------


def test_defaults():
    assert parse_args(Toy, []) == Toy()


def test_toml_values(tmp_path):
    path = _toml(
        tmp_path,
        """
        [job]
        dump_folder = "/tmp/run"

        [training]
        steps = 5
        lr = 1
        compile = true
        seq_len = 64
        mode = "full"
        precision = "bfloat16"
        datasets = ["web", "code"]
        ranks = [0, 3]
        factors = [1, 0.5]
        weights = { "web" = 0.7, "code" = 0.3 }
        """,
    )
    cfg = parse_args(Toy, ["--job.config_file", path])
    assert cfg.job == Job(config_file=path, dump_folder="/tmp/run")
    t = cfg.training
    assert (t.steps, t.lr, t.compile, t.seq_len, t.mode, t.precision) == (5, 1.0, True, 64, "full", "bfloat16")
    assert type(t.lr) is float and [type(f) for f in t.factors] == [float, float]
    assert (t.datasets, t.ranks, t.factors) == (["web", "code"], [0, 3], [1.0, 0.5])
    assert t.weights == {"web": 0.7, "code": 0.3}
    assert t.max_norm is None  # left out of the file: keeps its default


def test_toml_subtable_for_dict_field(tmp_path):
    path = _toml(tmp_path, "[training.weights]\nweb = 0.7\ncode = 1\n")
    assert parse_args(Toy, ["--job.config_file", path]).training.weights == {"web": 0.7, "code": 1.0}


def test_cli_overrides_toml(tmp_path):
    path = _toml(tmp_path, "[training]\nsteps = 5\nlr = 0.1\n")
    cfg = parse_args(Toy, ["--training.steps", "7", "--job.config_file", path])
    assert (cfg.training.steps, cfg.training.lr) == (7, 0.1)


@pytest.mark.parametrize("argv", [["--training.steps", "7"], ["--training.steps=7"]])
def test_space_and_equals_forms(argv):
    assert parse_args(Toy, argv).training.steps == 7


def test_last_flag_wins():
    assert parse_args(Toy, ["--training.steps", "1", "--training.steps=2"]).training.steps == 2


def test_negative_numbers_and_values_that_look_like_flags():
    cfg = parse_args(Toy, ["--training.steps", "-1", "--training.lr", "-1e-3", "--job.description=--x"])
    assert (cfg.training.steps, cfg.training.lr, cfg.job.description) == (-1, -1e-3, "--x")


def test_empty_string_value():
    assert parse_args(Toy, ["--job.dump_folder", ""]).job.dump_folder == ""


@pytest.mark.parametrize(
    "argv",
    [["--training.compile"], ["--training.compile", "--training.steps", "3"], ["--training.compile=true"]],
)
def test_bare_bool_flag_is_true(argv):
    assert parse_args(Toy, argv).training.compile is True


@pytest.mark.parametrize(
    "word, expected",
    [("true", True), ("True", True), ("1", True), ("yes", True), ("false", False), ("0", False), ("NO", False)],
)
def test_explicit_bool_values(word, expected):
    assert parse_args(Toy, ["--training.compile", word]).training.compile is expected
    assert parse_args(Toy, [f"--training.compile={word}"]).training.compile is expected


def test_lists_from_cli():
    cfg = parse_args(Toy, ["--training.datasets", "web, code", "--training.ranks=0,2", "--training.factors", "1,2.5"])
    assert (cfg.training.datasets, cfg.training.ranks, cfg.training.factors) == (["web", "code"], [0, 2], [1.0, 2.5])
    assert parse_args(Toy, ["--training.datasets", ""]).training.datasets == []
    assert parse_args(Toy, ["--training.ranks", "5"]).training.ranks == [5]


def test_dict_from_cli():
    cfg = parse_args(Toy, ["--training.weights", "web=0.7, code=0.3"])
    assert cfg.training.weights == {"web": 0.7, "code": 0.3}
    assert parse_args(Toy, ["--training.weights="]).training.weights == {}


def test_int_accepted_for_float_on_cli():
    lr = parse_args(Toy, ["--training.lr", "1"]).training.lr
    assert lr == 1.0 and type(lr) is float


def test_optional_fields():
    # `none` unsets an optional field unless "none" is a valid value of that field.
    cfg = parse_args(Toy, ["--training.seq_len", "128", "--training.max_norm", "0.5", "--training.async_save"])
    assert (cfg.training.seq_len, cfg.training.max_norm, cfg.training.async_save) == (128, 0.5, True)
    argv = ["--training.seq_len", "128", "--training.seq_len", "none", "--training.max_norm=None"]
    cfg = parse_args(Toy, [*argv, "--training.precision", "none"])
    assert (cfg.training.seq_len, cfg.training.max_norm, cfg.training.precision) == (None, None, None)
    cfg = parse_args(Toy, ["--job.description", "none", "--training.dtype", "none", "--training.mode", "none"])
    assert (cfg.job.description, cfg.training.dtype, cfg.training.mode) == ("none", "none", "none")


def test_nested_sections_and_default_factories(tmp_path):
    assert parse_args(Nested, []).model == Model(name="custom")  # the section's default_factory counts
    path = _toml(tmp_path, "seed = 3\n[model.attention]\nheads = 4\n")
    cfg = parse_args(Nested, ["--job.config_file", path, "--model.name", "moe"])
    assert (cfg.seed, cfg.model.name, cfg.model.attention.heads) == (3, "moe", 4)
    assert parse_args(Nested, ["--model.attention.heads=2", "--seed", "9"]).model.attention.heads == 2


def test_config_without_config_file_skips_toml():
    assert parse_args(NoConfigFile, ["--training.steps", "4"]) == NoConfigFile(Section(steps=4))
    assert "--job.config_file" in _error(NoConfigFile, ["--job.config_file", "x.toml"])


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["--training.steps", "x", "--no.such", "--help"]])
def test_help_requested(argv):
    with pytest.raises(HelpRequested):
        parse_args(Toy, argv)


# ----- errors ------------------------------------------------------------------------------------------


def test_unknown_key_in_toml(tmp_path):
    path = _toml(tmp_path, "[training]\nstpes = 5\n")
    msg = _error(Toy, ["--job.config_file", path])
    assert "'training.stpes'" in msg and path in msg and "did you mean 'training.steps'?" in msg


def test_unknown_section_in_toml(tmp_path):
    path = _toml(tmp_path, "[trainng]\nsteps = 5\n")
    msg = _error(Toy, ["--job.config_file", path])
    assert "Unknown section 'trainng'" in msg and path in msg and "did you mean 'training'?" in msg


def test_section_given_as_value_in_toml(tmp_path):
    path = _toml(tmp_path, "training = 3\n")
    msg = _error(Toy, ["--job.config_file", path])
    assert "'training'" in msg and path in msg and "must be a table" in msg


def test_unknown_option_on_cli():
    msg = _error(Toy, ["--training.stpes", "5"])
    assert "'--training.stpes'" in msg and "command line" in msg and "did you mean '--training.steps'?" in msg


def test_unknown_option_without_close_match():
    msg = _error(Toy, ["--zzz.qqq", "5"])
    assert "'--zzz.qqq'" in msg and "command line" in msg and "--help" in msg


def test_unexpected_positional_argument():
    msg = _error(Toy, ["stray"])
    assert "'stray'" in msg and "command line" in msg


@pytest.mark.parametrize(
    "toml_line, key, expected, got",
    [
        ('steps = "ten"', "training.steps", "int", "'ten'"),
        ("steps = 3.5", "training.steps", "int", "3.5"),
        ("steps = true", "training.steps", "int", "True"),
        ("lr = true", "training.lr", "float", "True"),
        ("compile = 1", "training.compile", "bool", "1"),
        ("seq_len = 1.5", "training.seq_len", "int | None", "1.5"),
        ('ranks = ["a"]', "training.ranks", "list[int]", "['a']"),
        ('datasets = "web"', "training.datasets", "list[str]", "'web'"),
        ('weights = { "web" = "a lot" }', "training.weights", "dict[str, float]", "{'web': 'a lot'}"),
        ("weights = [0.7]", "training.weights", "dict[str, float]", "[0.7]"),
    ],
)
def test_wrong_type_in_toml(tmp_path, toml_line, key, expected, got):
    path = _toml(tmp_path, f"[training]\n{toml_line}\n")
    msg = _error(Toy, ["--job.config_file", path])
    assert f"'{key}'" in msg and path in msg and f"expected {expected}." in msg and f"value {got} " in msg


def test_wrong_type_of_str_field_in_toml(tmp_path):
    path = _toml(tmp_path, "[job]\ndump_folder = 3\n")
    msg = _error(Toy, ["--job.config_file", path])
    assert "'job.dump_folder'" in msg and path in msg and "expected str" in msg


@pytest.mark.parametrize(
    "argv, key, expected, got",
    [
        (["--training.steps", "abc"], "training.steps", "int", "'abc'"),
        (["--training.steps=3.5"], "training.steps", "int", "'3.5'"),
        (["--training.lr", "fast"], "training.lr", "float", "'fast'"),
        (["--training.seq_len", "long"], "training.seq_len", "int | None", "'long'"),
        (["--training.ranks", "0,x"], "training.ranks", "list[int]", "'0,x'"),
        (["--training.weights", "web=heavy"], "training.weights", "dict[str, float]", "'web=heavy'"),
    ],
)
def test_wrong_type_on_cli(argv, key, expected, got):
    msg = _error(Toy, argv)
    assert f"'{key}'" in msg and "command line" in msg and f"expected {expected}." in msg and f"value {got} " in msg


def test_bad_bool_on_cli():
    msg = _error(Toy, ["--training.compile", "maybe"])
    assert "'training.compile'" in msg and "'maybe'" in msg and "command line" in msg and "true/false" in msg


def test_malformed_dict_on_cli():
    msg = _error(Toy, ["--training.weights", "web"])
    assert "'training.weights'" in msg and "command line" in msg and "name=value" in msg


@pytest.mark.parametrize("argv", [["--training.steps"], ["--training.steps", "--training.lr", "1"]])
def test_flag_without_value(argv):
    msg = _error(Toy, argv)
    assert "'--training.steps'" in msg and "needs a value" in msg and "int" in msg


def test_invalid_literal_choice_on_cli():
    msg = _error(Toy, ["--training.mode", "ful"])
    assert "'training.mode'" in msg and "command line" in msg and "'ful'" in msg
    assert "one of 'none', 'full', 'selective'" in msg and "did you mean 'full'?" in msg


def test_invalid_literal_choice_in_toml(tmp_path):
    path = _toml(tmp_path, '[training]\nprecision = "fp8"\n')
    msg = _error(Toy, ["--job.config_file", path])
    assert "'training.precision'" in msg and path in msg and "one of 'float32', 'bfloat16'" in msg


def test_missing_config_file(tmp_path):
    path = str(tmp_path / "nope.toml")
    msg = _error(Toy, ["--job.config_file", path])
    assert "not found" in msg and path in msg


def test_toml_syntax_error(tmp_path):
    path = _toml(tmp_path, "[training]\nsteps = = 5\n")
    msg = _error(Toy, ["--job.config_file", path])
    assert "Invalid TOML" in msg and path in msg and "line 2" in msg


def test_config_file_that_is_a_folder(tmp_path):
    msg = _error(Toy, ["--job.config_file", str(tmp_path)])
    assert str(tmp_path) in msg


def test_unsupported_field_type_is_a_programming_error():
    with pytest.raises(TypeError, match="bad.values"):
        parse_args(BadConfig, [])


# ----- help --------------------------------------------------------------------------------------------


def test_help_lists_every_option_with_type_default_and_doc():
    text = format_help(Toy, "train.py")
    assert text.startswith("usage: train.py [--job.config_file PATH] [--section.key VALUE ...]")
    for section in dataclasses.fields(Toy):
        assert f"[{section.name}]" in text
        for f in dataclasses.fields(section.type):
            assert f"--{section.name}.{f.name} " in text and f.metadata["help"] in text
    lines = {line.split()[0]: " ".join(line.split()) for line in text.splitlines() if line.startswith("  --")}
    assert lines["--training.steps"] == "--training.steps int (default: 10) optimizer steps"
    assert lines["--training.lr"].startswith("--training.lr float (default: 0.0003)")
    assert lines["--training.compile"].startswith("--training.compile bool (default: false)")
    assert lines["--training.seq_len"].startswith("--training.seq_len int | None (default: none)")
    assert lines["--training.mode"].startswith('--training.mode {none,full,selective} (default: "none")')
    assert lines["--training.datasets"].startswith('--training.datasets list[str] (default: ["c4"])')
    assert lines["--training.weights"].startswith("--training.weights dict[str, float] (default: {})")
    assert lines["--job.dump_folder"].startswith('--job.dump_folder str (default: "./outputs")')


def test_help_for_nested_config_and_config_without_file():
    text = format_help(Nested, "prog")
    assert "[model.attention]" in text and "--model.attention.heads int (default: 8)" in text
    assert '--model.name str (default: "custom")' in text and "--seed int (default: 0)" in text
    assert "--job.config_file" not in format_help(NoConfigFile, "prog").splitlines()[0]


# ----- TOML output -------------------------------------------------------------------------------------


def _round_trip(tmp_path: Path, cfg):
    path = tmp_path / "dump.toml"
    path.write_text(to_toml(cfg))
    loaded = parse_args(type(cfg), ["--job.config_file", str(path)])
    return loaded, dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, config_file=str(path)))


def test_to_toml_round_trip(tmp_path):
    tricky = 'quote " back \\ newline \n tab \t bell \x07 del \x7f unicode é 🚀 [x] # y = z'
    cfg = parse_args(
        Toy,
        [
            "--job.description", tricky,
            "--job.dump_folder", "C:\\runs\\a",
            "--training.steps", "-3",
            "--training.lr", "1e-05",
            "--training.compile",
            "--training.seq_len", "64",
            "--training.max_norm", "inf",
            "--training.async_save", "false",
            "--training.mode", "selective",
            "--training.dtype", "none",
            "--training.precision", "bfloat16",
            "--training.datasets", "a b,c\"d",
            "--training.ranks", "",
            "--training.factors", "0.1,2",
            "--training.weights", "web=0.7,odd key=0.3",
        ],
    )  # fmt: skip
    loaded, expected = _round_trip(tmp_path, cfg)
    assert loaded == expected
    assert loaded.job.description == tricky


def test_to_toml_round_trip_of_defaults_and_nested(tmp_path):
    loaded, expected = _round_trip(tmp_path, Toy())
    assert loaded == expected
    cfg = parse_args(Nested, ["--seed", "5", "--model.attention.heads", "2"])
    loaded, expected = _round_trip(tmp_path, cfg)
    assert loaded == expected


def test_to_toml_layout():
    cfg = parse_args(Toy, ["--training.weights", "web=0.7", "--training.steps", "3"])
    text = to_toml(cfg)
    data = tomllib.loads(text)
    assert set(data) == {"job", "training"} and data["training"]["steps"] == 3
    assert data["training"]["weights"] == {"web": 0.7}
    assert '{ "web" = 0.7 }' in text
    assert "seq_len" not in data["training"] and "# seq_len is None (TOML has no null)" in text
    nested = tomllib.loads(to_toml(Nested()))
    assert nested["seed"] == 0 and nested["model"]["attention"] == {"heads": 8}


def test_to_dict():
    assert to_dict(Nested())["model"] == {"name": "custom", "attention": {"heads": 8}}
