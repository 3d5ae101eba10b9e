"""torchpre's dependencies run one way: no import cycles between modules or between packages, no package
importing one of a higher layer, and no function-level import of torchpre code to dodge a cycle.

The graph is read with `ast` from the source (function-level and `TYPE_CHECKING` imports included), so the
test needs nothing imported and catches an import that only runs on some code path.
"""

import ast
import importlib.util
import re
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "torchpre"

# Bottom to top. A unit (a subpackage or top-level module of torchpre, or `train` for train.py) may import its own
# layer's and lower layers' units, never a higher one's. Within a layer, imports are allowed as long as they form no
# cycle between units. `errors`, `optional`, `confined` and `json_input` are the leaves; `distributed` the mesh,
# collectives and name helpers, and `step_rules` the torch-free rules of a step (pipeline schedules, ZeRO stages,
# batch sizes, the ramp); `config` the job's sections (torch-free: tests/unit/test_help_without_torch.py), which the
# layers above read; `parallel` the parallelize machinery and the data-parallel strategy; then the components built
# on it, each from its config section (`evaluation` the held-out loss and downstream tasks, `interchange` Hugging Face
# folders in and out); then the job's model assembled from them (`assembly`: args, layout checks, the meta model, its
# plans); then the training loop that sequences them; then the planner (dry run included) and the entry points
# (`python -m torchpre.X`). `runtime` holds what every entry point shares (the runner of entry points, custom imports)
# and the job's runtime services (determinism, preemption, GC, profiling, the world it runs in).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "optional", "confined", "json_input"),
    ("distributed", "step_rules"),
    ("config",),
    ("parallel",),
    ("optim", "models", "data", "checkpoint", "metrics", "health", "runtime", "evaluation", "interchange"),
    ("assembly",),
    ("training",),
    ("planner", "train", "generate", "convert", "plot", "plan"),
)

# Function-level imports of torchpre modules, by (importing module, imported module): each with its reason.
# Function-level imports of other packages are allowed (optional dependencies; tests/unit/test_dependencies.py
# checks that they are declared).
LAZY_IMPORTS: dict[tuple[str, str], str] = {
    ("torchpre.train", "torchpre.training.trainer"): "entry point: `--help` and bad flags answer before torch loads "
    "(tests/unit/test_help_without_torch.py)",
    ("torchpre.train", "torchpre.planner.dryrun"): "entry point: loads torch, like the trainer it builds",
    ("torchpre.plan", "torchpre.planner.search"): "entry point: `--help` and bad flags answer before torch "
    "loads",
    ("torchpre.plan", "torchpre.planner.given_layout"): "entry point: only --fixed needs it (and torch)",
    ("torchpre.plan", "torchpre.planner.hf_flavor"): "entry point: after the flags are checked, as the search's",
    ("torchpre.plan", "torchpre.planner.predict"): "entry point: the error bars are printed after a search, with torch "
    "loaded",
    ("torchpre.plan", "torchpre.planner.calibrate"): "entry point: only --calibrate needs it (and torch)",
    ("torchpre.plan", "torchpre.planner.plot"): "entry point: only --plot needs it (and matplotlib)",
    ("torchpre.runtime.cli", "torchpre.config.job_config"): "imported by every entry point before it parses its flags",
    ("torchpre.runtime.cli", "torchpre.config.parser"): "imported by every entry point before it parses its flags",
    ("torchpre.runtime.cli", "torchpre.distributed.process_groups"): "loads torch; only needed once the job has run or "
    "failed",
    ("torchpre.runtime.cli", "torchpre.distributed.peer_exit"): "loads torch; only needed once a rank of a torchrun "
    "job has failed",
    ("torchpre.data.documents", "torchpre.data.corpus"): "the built-in corpus reads the standard library's "
    "sources; only the 'stdlib' dataset needs it",
}


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    line: int
    lazy: bool  # inside a function


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files() -> dict[str, Path]:
    files = {module_name(p): p for p in sorted((REPO / PACKAGE).rglob("*.py"))}
    files["train"] = REPO / "train.py"
    return files


def _imported_names(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool) -> Iterable[str]:
    """Candidate module names an import statement loads: for `from a.b import c`, both `a.b.c` and `a.b`."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = node.module or ""
    if node.level:
        anchor = importer.split(".") if is_package else importer.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, base] if base else anchor)
    for alias in node.names:
        yield f"{base}.{alias.name}"
    yield base


class _ImportVisitor(ast.NodeVisitor):
    def __init__(self, importer: str, is_package: bool, modules: set[str]):
        self.importer, self.is_package, self.modules = importer, is_package, modules
        self.depth = 0
        self.edges: list[Edge] = []

    def _function(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def _import(self, node: ast.Import | ast.ImportFrom) -> None:
        for name in _imported_names(node, self.importer, self.is_package):
            if name in self.modules and name != self.importer:
                self.edges.append(Edge(self.importer, name, node.lineno, self.depth > 0))
                if isinstance(node, ast.ImportFrom):
                    return  # `from a.b import c`: a.b.c if it is a module (checked first), else a.b

    visit_Import = visit_ImportFrom = _import


def import_edges(sources: dict[str, str], packages: set[str]) -> list[Edge]:
    """Every import of one of `sources`' modules by another, from their source text."""
    modules = set(sources)
    edges = []
    for name, text in sources.items():
        visitor = _ImportVisitor(name, name in packages, modules)
        visitor.visit(ast.parse(text))
        edges.extend(visitor.edges)
    return edges


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a list of nodes, the first repeated at the end) per strongly connected component of size > 1
    or with a self loop (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph.get(succ, ())))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in graph.get(node, ()):
                        components.append(component)
    return [_cycle_through(graph, set(c)) for c in components]


def _cycle_through(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle from the component's first node back to itself, within the component (BFS)."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for succ in sorted(graph.get(node, ())):
                if succ not in component:
                    continue
                if succ == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if succ not in parents:
                    parents[succ] = node
                    following.append(succ)
        frontier = following
    raise AssertionError(f"no cycle in {component}")


def unit(module: str) -> str:
    """The layered unit of a module: its torchpre subpackage or top-level module (`train` for train.py)."""
    parts = module.split(".")
    return parts[1] if parts[0] == PACKAGE and len(parts) > 1 else parts[0]


def layer_of() -> dict[str, int]:
    return {name: level for level, names in enumerate(LAYERS) for name in names}


def _load_graph() -> list[Edge]:
    files = source_files()
    packages = {name for name, path in files.items() if path.name == "__init__.py"}
    return import_edges({name: path.read_text() for name, path in files.items()}, packages)


def _graph(pairs: Iterable[tuple[str, str]]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for a, b in pairs:
        graph.setdefault(a, set()).add(b)
    return graph


def _describe(cycles: list[list[str]]) -> str:
    return "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_no_module_import_cycle():
    cycles = find_cycles(_graph((e.importer, e.imported) for e in _load_graph()))
    assert not cycles, f"import cycles between modules:\n{_describe(cycles)}"


def test_no_package_import_cycle():
    pairs = ((unit(e.importer), unit(e.imported)) for e in _load_graph())
    cycles = find_cycles(_graph((a, b) for a, b in pairs if a != b))
    assert not cycles, f"import cycles between packages:\n{_describe(cycles)}"


def test_every_unit_has_a_layer():
    layers = layer_of()
    units = {unit(name) for name in source_files()} - {PACKAGE}
    assert units <= set(layers), f"give these a place in LAYERS: {sorted(units - set(layers))}"


def test_no_lower_layer_imports_a_higher_one():
    layers = layer_of()
    upward = [
        f"{e.importer} (layer {layers[unit(e.importer)]}) imports {e.imported} (layer {layers[unit(e.imported)]}), "
        f"line {e.line}"
        for e in _load_graph()
        if unit(e.importer) in layers and unit(e.imported) in layers
        if layers[unit(e.importer)] < layers[unit(e.imported)]
    ]
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


def test_function_level_imports_are_the_listed_exceptions():
    lazy = {(e.importer, e.imported): e.line for e in _load_graph() if e.lazy}
    unlisted = [f"{a} imports {b} inside a function (line {line})" for (a, b), line in lazy.items()
                if (a, b) not in LAZY_IMPORTS]
    assert not unlisted, (
        "function-level imports of torchpre modules (import at the top, or list them in LAZY_IMPORTS with the "
        "reason):\n" + "\n".join(unlisted)
    )


def test_a_synthetic_cycle_is_reported_with_its_path():
    sources = {
        "pkg": "",
        "pkg.a": "from pkg.b import f\n",
        "pkg.b": "def f():\n    from pkg import c\n",
        "pkg.c": "import pkg.a\n",
        "pkg.d": "from . import a\n",
    }
    edges = import_edges(sources, packages={"pkg"})
    assert {(e.importer, e.imported, e.lazy) for e in edges} == {
        ("pkg.a", "pkg.b", False), ("pkg.b", "pkg.c", True), ("pkg.c", "pkg.a", False), ("pkg.d", "pkg.a", False),
    }
    cycles = find_cycles(_graph((e.importer, e.imported) for e in edges))
    assert cycles == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]
    assert _describe(cycles) == "pkg.a -> pkg.b -> pkg.c -> pkg.a"
    assert find_cycles({"x": {"y"}, "y": set()}) == []
    assert find_cycles({"x": {"x"}}) == [["x", "x"]]


def test_the_architecture_page_lists_the_layers():
    """docs/architecture.md's table of layers is `LAYERS`, in order, so the map contributors read is the rule."""
    page = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    table = page.split("<!-- layers:", 1)[1].split("<!-- /layers -->", 1)[0]
    rows = [line.split("|")[2] for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [tuple(re.findall(r"`([a-z_]+)`", packages)) for packages in rows] == list(LAYERS)


def test_the_architecture_page_draws_the_layers():
    """docs/architecture.md's layer picture is what scripts/layer_diagram.py writes from `LAYERS`."""
    result = subprocess.run([sys.executable, "scripts/layer_diagram.py", "--check"], cwd=REPO, capture_output=True,
                            text=True)  # fmt: skip
    assert result.returncode == 0, result.stderr


def test_the_layer_diagram_has_one_box_per_layer_and_an_arrow_down_from_each():
    spec = importlib.util.spec_from_file_location("layer_diagram", REPO / "scripts" / "layer_diagram.py")
    layer_diagram = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(layer_diagram)
    assert layer_diagram.read_layers() == list(LAYERS)
    assert layer_diagram.diagram([("errors",), ("config", "parallel")]) == "\n".join([
        "```mermaid", "flowchart TD", '    L2["2: config · parallel"]', '    L1["1: errors"]',
        "    L2 -->|may import| L1", "```"])  # fmt: skip
