"""Where a ConfigError may be raised (docs/architecture.md, "Where a key is checked"): in torchpre/config/, or in a
section's resolve step (a function marked `@resolve_step`) and the functions of its module it calls. The raises
anywhere else are counted and pinned, so the number can only fall; and preflight must run every resolve step, so a
mark is not a name only."""

import ast
import dataclasses
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.hf_folders import write_llama_folder
from torchpre.config.job_config import JobConfig
from torchpre.config.parser import parse_args
from torchpre.errors import ConfigError, resolve_step
from torchpre.models.llama3.args import LLAMA3_FLAVORS
from torchpre.training import preflight

PACKAGE = Path(__file__).resolve().parents[2] / "torchpre"
PREFLIGHT = PACKAGE / "training" / "preflight.py"
FAMILIES = PACKAGE / "models"  # a family's step checks its args; preflight's [model] step builds them

# `raise ConfigError` outside config/ and the resolve steps (216 when issue 64 was filed; 204 before the steps).
# Lower this when you move a check into its section's step; never raise it.
RAISES_OUTSIDE = 60


@dataclass(frozen=True)
class Step:
    path: Path
    qualname: str  # as the code object names it: "ParallelDims.from_degrees"


def _is_step(node: ast.FunctionDef) -> bool:
    names = (d.id if isinstance(d, ast.Name) else getattr(d, "attr", None) for d in node.decorator_list)
    return "resolve_step" in names


def _raises_config_error(node: ast.AST) -> bool:
    if not isinstance(node, ast.Raise) or node.exc is None:
        return False
    called = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
    return isinstance(called, ast.Name) and called.id == "ConfigError"


class _Module:
    """One file's functions by qualified name, the resolve steps among them and what each calls in the file."""

    def __init__(self, path: Path):
        self.path = path
        self.tree = ast.parse(path.read_text())
        self.functions: dict[str, ast.FunctionDef] = {}
        self._collect(self.tree, "")

    def _collect(self, node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                self._collect(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef):
                self.functions[f"{prefix}{child.name}"] = child

    def steps(self) -> list[str]:
        return [name for name, node in self.functions.items() if _is_step(node)]

    def _callees(self, qualname: str) -> Iterator[str]:
        """Functions of this file that `qualname` calls by name, or on `self` / `cls` / its class."""
        owner = qualname.rpartition(".")[0]
        for node in ast.walk(self.functions[qualname]):
            if not isinstance(node, ast.Call):
                continue
            if isinstance(node.func, ast.Name) and node.func.id in self.functions:
                yield node.func.id
            elif isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name) and owner:
                if node.func.value.id in ("self", "cls", owner.rpartition(".")[2]):
                    if f"{owner}.{node.func.attr}" in self.functions:
                        yield f"{owner}.{node.func.attr}"

    def homes(self) -> set[str]:
        """The resolve steps and the functions of this file they reach."""
        reached, todo = set(), self.steps()
        while todo:
            name = todo.pop()
            if name not in reached:
                reached.add(name)
                todo.extend(self._callees(name))
        return reached

    def raises_outside_homes(self) -> list[int]:
        """Line numbers of `raise ConfigError` outside every home (a nested function counts as its outer one's)."""
        homes = {id(self.functions[name]) for name in self.homes()}
        lines: list[int] = []

        def walk(node: ast.AST, home: bool) -> None:
            for child in ast.iter_child_nodes(node):
                inside = home or id(child) in homes
                if _raises_config_error(child) and not inside:
                    lines.append(child.lineno)
                walk(child, inside)

        walk(self.tree, False)
        return lines


def _modules() -> list[_Module]:
    return [_Module(path) for path in sorted(PACKAGE.rglob("*.py"))]


def _steps() -> list[Step]:
    return [Step(module.path, name) for module in _modules() for name in module.steps()]


def raises_outside_resolve_steps() -> dict[str, list[int]]:
    """{file: lines} of every `raise ConfigError` outside config/ and the resolve steps."""
    config = PACKAGE / "config"
    found = {str(m.path.relative_to(PACKAGE.parent)): m.raises_outside_homes() for m in _modules()
             if config not in m.path.parents}  # fmt: skip
    return {path: lines for path, lines in found.items() if lines}


def test_config_errors_outside_the_resolve_steps_do_not_grow() -> None:
    found = raises_outside_resolve_steps()
    count = sum(len(lines) for lines in found.values())
    by_file = sorted(((len(lines), path) for path, lines in found.items()), reverse=True)
    assert count <= RAISES_OUTSIDE, (
        f"{count} `raise ConfigError` outside config/ and the resolve steps, more than {RAISES_OUTSIDE}: check a key "
        f"in its section's resolve step (docs/architecture.md). By file: {by_file}"
    )
    assert count == RAISES_OUTSIDE, f"{count} now: lower RAISES_OUTSIDE to {count} so the number cannot grow back."


def test_architecture_md_states_the_pinned_count() -> None:
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert f"number ({RAISES_OUTSIDE} today, its `RAISES_OUTSIDE`" in page


def test_the_counter_sees_a_raise_in_a_helper_of_a_step_as_home_and_one_elsewhere_as_outside(tmp_path: Path) -> None:
    source = tmp_path / "section.py"
    source.write_text(
        "from torchpre.errors import ConfigError, resolve_step\n"
        "@resolve_step\n"
        "def resolve_section(x):\n"
        "    _check(x)\n"
        "    return Dims.build(x)\n"
        "def _check(x):\n"
        "    raise ConfigError('home: a helper the step calls')\n"
        "class Dims:\n"
        "    @classmethod\n"
        "    def build(cls, x):\n"
        "        return cls._more(x)\n"
        "    @classmethod\n"
        "    def _more(cls, x):\n"
        "        raise ConfigError('outside: Dims.build is not reached from the step through the file')\n"
        "def deeper(x):\n"
        "    raise ConfigError('outside')\n"
    )
    module = _Module(source)
    assert module.steps() == ["resolve_section"]
    assert module.homes() == {"resolve_section", "_check"}
    assert module.raises_outside_homes() == [14, 16]


def test_preflight_calls_each_resolve_step_outside_the_model_families_itself() -> None:
    """One visible sequence: a reader of `preflight` sees every step by name (a family's step checks its args and
    runs when preflight's [model] step builds them)."""
    tree = ast.parse(PREFLIGHT.read_text())
    body = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "preflight")
    imported = {alias.asname: alias.name for node in tree.body if isinstance(node, ast.ImportFrom)
                for alias in node.names if alias.asname}  # fmt: skip
    called = {node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
              for node in ast.walk(body) if isinstance(node, ast.Call)}  # fmt: skip
    called |= {imported[name] for name in called if name in imported}
    steps = [step for step in _steps() if FAMILIES not in step.path.parents]
    assert len(steps) >= 8, steps
    missing = [step for step in steps if step.qualname.rpartition(".")[2] not in called]
    assert missing == [], f"resolve steps that preflight does not call by name: {missing}"


def _family_jobs(folder: Path) -> list[tuple[JobConfig, int]]:
    """One job per model family with every section a step resolves in use: a pipeline, data stages, a ramp, a
    released folder's weights."""
    common = ["--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder", str(folder),
              "--training.seq_len", "64", "--training.steps", "10"]  # fmt: skip
    released = folder / "released"
    write_llama_folder(released, dataclasses.replace(LLAMA3_FLAVORS["tiny"], n_layers=3))
    return [
        (parse_args(JobConfig, [*common, "--model.flavor", "from_hf", "--checkpoint.initial_load_path",
                                str(released)]), 1),  # fmt: skip
        (parse_args(JobConfig, [*common, "--parallelism.pipeline_parallel_degree", "2", "--training.global_batch_size",
                                "16", "--training.batch_rampup", "8,8,64", "--parallelism.tensor_parallel_degree",
                                "2"]), 4),  # fmt: skip
        (parse_args(JobConfig, [*common, "--model.name", "moe", "--model.flavor", "debugmodel",
                                "--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree",
                                "2"]), 4),  # fmt: skip
        (parse_args(JobConfig, [*common, "--model.name", "deepseek_v3", "--model.flavor", "debugmodel"]), 1),
        (parse_args(JobConfig, [*common, "--model.name", "hf", "--model.hf_config",
                                "assets/hf_configs/qwen2_tiny.json"]), 1),  # fmt: skip
    ]


def test_preflight_runs_every_resolve_step(tmp_path: Path) -> None:
    """Every marked step runs in the preflight of one of the families' jobs: a step preflight never runs would be a
    mark on checks that fire later, after work has started."""
    ran: set[tuple[str, str]] = set()

    def record(frame, event: str, arg: object) -> None:
        if event == "call":
            ran.add((frame.f_code.co_filename, frame.f_code.co_qualname))

    for config, world_size in _family_jobs(tmp_path):
        sys.setprofile(record)
        try:
            preflight.preflight(config, world_size)
        finally:
            sys.setprofile(None)
    not_run = [step for step in _steps() if (str(step.path), step.qualname) not in ran]
    assert not_run == [], f"resolve steps that preflight did not run: {not_run}"


def test_the_mark_changes_nothing() -> None:
    def step() -> int:
        return 1

    assert resolve_step(step) is step


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (["--model.rope_low_freq_factor", "2"], "model.rope_low_freq_factor = 2.0 shapes Llama 3.1 RoPE scaling"),
        (["--model.name", "deepseek_v3", "--model.n_kv_heads", "2"], "model.n_kv_heads = 2 with model.name = "),
        (["--model.name", "deepseek_v3", "--model.flavor", "2B", "--model.dim", "1000"], "a multiple of 3"),
        (["--model.flavor", "debugmodell"], "model.flavor = 'debugmodell' is not a flavor of 'llama3'"),
    ],
)
def test_the_model_keys_applied_to_a_flavor_are_refused_in_preflight(tmp_path: Path, keys: list[str], message: str):
    """The shape, RoPE and flavor checks that moved into the [model] step fire in preflight, before any work."""
    config = parse_args(JobConfig, ["--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder",
                                    str(tmp_path), "--training.seq_len", "64", *keys])  # fmt: skip
    with pytest.raises(ConfigError, match=re.escape(message)):
        preflight.preflight(config, 1)
