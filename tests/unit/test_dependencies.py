"""Every third-party package that torchpre imports is declared in pyproject.toml: in the base dependencies when
an entry point imports it whenever it runs, in an extra when the import is lazy (inside a function, or guarded
by `except ImportError`). A fresh `pip install -e .` must be enough to train; a green CI on a machine where
packages were installed by hand must not hide a missing declaration."""

import ast
import functools
import importlib.metadata
import re
import sys
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "torchpre"

# What a user runs; whatever these import when they run must come with the base install.
ENTRY_POINTS = (
    "train.py", "torchpre/train.py", "torchpre/generate.py", "torchpre/convert.py", "torchpre/data/prepare.py"
)

# Standard-library modules of a newer Python than the oldest supported one (imported behind a version check).
NEWER_STDLIB = {"tomllib"}
# Modules only type checkers have (typeshed's stubs), imported under `if TYPE_CHECKING:`.
TYPE_CHECKER_ONLY = {"_typeshed"}

# Import names whose distribution has another name and that may not be installed where this test runs.
DISTRIBUTION_OF = {"yaml": "pyyaml", "PIL": "pillow", "sklearn": "scikit-learn"}


@dataclass(frozen=True)
class Import:
    """One import statement's top-level name, where it is, and whether it runs whenever its module is imported."""

    module: str
    path: str
    line: int
    eager: bool


def _normalize(name: str) -> str:
    """PEP 503 name normalization: 'Flash_Attn' and 'flash-attn' are one distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    return _normalize(re.match(r"[A-Za-z0-9._-]+", requirement.strip()).group(0))


def declared() -> tuple[set[str], dict[str, set[str]]]:
    """The base dependencies and each extra's, as normalized distribution names."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    base = {_requirement_name(r) for r in project["dependencies"]}
    extras = {name: {_requirement_name(r) for r in reqs} for name, reqs in project["optional-dependencies"].items()}
    return base, extras


@functools.cache
def _installed_distributions() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def _distributions(import_name: str) -> set[str]:
    """The distributions that provide a top-level import name (installed ones answer for themselves)."""
    installed = _installed_distributions().get(import_name, [])
    if installed:
        return {_normalize(d) for d in installed}
    return {_normalize(DISTRIBUTION_OF.get(import_name, import_name))}


def _guards_import_error(handler: ast.ExceptHandler) -> bool:
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError") for n in names)


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


class _ImportCollector(ast.NodeVisitor):
    """Collects imports, marking those inside functions, `if TYPE_CHECKING:` or `try/except ImportError` lazy;
    `import_optional("pkg", ...)` calls count as lazy imports of `pkg`."""

    def __init__(self, path: str):
        self.path = path
        self.imports: list[Import] = []
        self._lazy_depth = 0

    def _lazy(self, nodes: list[ast.AST]) -> None:
        self._lazy_depth += 1
        for node in nodes:
            self.visit(node)
        self._lazy_depth -= 1

    def _add(self, name: str, node: ast.AST) -> None:
        self.imports.append(Import(name, self.path, node.lineno, eager=self._lazy_depth == 0))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0:
            self._add(node.module, node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._lazy(node.body)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node):
            self._lazy(node.body)
        else:
            self.generic_visit(node)

    def visit_Try(self, node: ast.Try) -> None:
        if any(_guards_import_error(h) for h in node.handlers):
            self._lazy(node.body)
            for part in (node.handlers, node.orelse, node.finalbody):
                for child in part:
                    self.visit(child)
        else:
            self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Name) and node.func.id == "import_optional" and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                self.imports.append(Import(first.value, self.path, node.lineno, eager=False))
        self.generic_visit(node)


@functools.cache
def imports_of(path: Path) -> list[Import]:
    collector = _ImportCollector(str(path.relative_to(REPO)))
    collector.visit(ast.parse(path.read_text(), filename=str(path)))
    return collector.imports


def _module_file(module: str) -> Path | None:
    base = REPO / Path(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _package_files(module: str) -> list[Path]:
    """The files Python runs to import `module`: each enclosing package's __init__.py, then the module."""
    parts = module.split(".")
    files = [_module_file(".".join(parts[:i])) for i in range(1, len(parts) + 1)]
    return [f for f in files if f is not None]


def always_imported_files() -> set[Path]:
    """Files an entry point runs on every invocation: everything the entry points import (anywhere in them), then
    the module-level imports of those modules, transitively."""
    seen: set[Path] = set()
    pending: list[Path] = []
    for entry in ENTRY_POINTS:
        path = REPO / entry
        seen.add(path)
        for imp in imports_of(path):
            if imp.module.split(".")[0] == PACKAGE:
                pending.extend(_package_files(imp.module))
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen.add(path)
        for imp in imports_of(path):
            if imp.eager and imp.module.split(".")[0] == PACKAGE:
                pending.extend(_package_files(imp.module))
    return seen


def _third_party(module: str) -> str | None:
    top = module.split(".")[0]
    if top in sys.stdlib_module_names or top in NEWER_STDLIB or top in TYPE_CHECKER_ONLY or top == PACKAGE:
        return None
    return top


def undeclared_imports() -> list[str]:
    """One line per import that a fresh install with the declared dependencies would not satisfy."""
    base, extras = declared()
    in_some_extra = set().union(*extras.values())
    always = always_imported_files()
    files = sorted(REPO.joinpath(PACKAGE).rglob("*.py")) + [REPO / "train.py"]
    problems = []
    for path in files:
        for imp in imports_of(path):
            top = _third_party(imp.module)
            if top is None:
                continue
            providers = _distributions(top)
            where = f"{imp.path}:{imp.line} imports '{imp.module}'"
            if imp.eager and path in always:
                if not providers & base:
                    problems.append(f"{where} whenever an entry point runs, but none of {sorted(providers)} is in "
                                    "[project] dependencies")
            elif not providers & (base | in_some_extra):
                problems.append(f"{where}, but none of {sorted(providers)} is a dependency or in an extra")
    return problems


def test_every_import_is_declared() -> None:
    problems = undeclared_imports()
    assert not problems, "Undeclared imports:\n" + "\n".join(problems)


def test_the_check_sees_entry_point_imports() -> None:
    """The walk reaches the trainer through train.py's function-level import, and finds numpy there."""
    always = always_imported_files()
    assert REPO / "torchpre/training/trainer.py" in always
    assert REPO / "torchpre/runtime/determinism.py" in always
    assert REPO / "torchpre/plot.py" not in always
    numpy_imports = [i for i in imports_of(REPO / "torchpre/runtime/determinism.py") if i.module == "numpy"]
    assert numpy_imports and numpy_imports[0].eager


def test_lazy_and_guarded_imports_are_told_apart() -> None:
    flash = [i for i in imports_of(REPO / "torchpre/models/attention.py") if i.module == "flash_attn"]
    assert flash and not flash[0].eager
    plot = {i.module: i.eager for i in imports_of(REPO / "torchpre/plot.py")}
    assert plot["matplotlib"] is False and plot["matplotlib.figure"] is False


def test_a_missing_base_dependency_is_reported(monkeypatch) -> None:
    """Dropping numpy from the declared base dependencies is caught, naming the module and the import."""
    base, extras = declared()
    monkeypatch.setattr(sys.modules[__name__], "declared", lambda: (base - {"numpy"}, extras))
    problems = undeclared_imports()
    assert any("torchpre/runtime/determinism.py" in p and "'numpy'" in p for p in problems), problems
