"""No two classes in torchpre/ share a name: a reader (or a traceback, or `from x import Name`) that meets a class
name knows which one is meant without looking at the module."""

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "torchpre"


def classes_by_name(root: Path) -> dict[str, list[str]]:
    """Each class name defined under `root` (nested classes included) -> the files that define it."""
    found: dict[str, list[str]] = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                found[node.name].append(str(path.relative_to(root.parent)))
    return found


def test_no_two_classes_in_torchpre_share_a_name():
    shared = {name: files for name, files in classes_by_name(PACKAGE).items() if len(files) > 1}
    assert shared == {}


def test_a_shared_name_is_found(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "a.py").write_text("class Layout:\n    pass\n\nclass Plan:\n    pass\n")
    (package / "sub" / "b.py").write_text("def f():\n    class Layout:\n        pass\n")
    assert classes_by_name(package) == {"Layout": ["pkg/a.py", "pkg/sub/b.py"], "Plan": ["pkg/a.py"]}
