"""scripts/mutation_check.py's breaks still point at code and tests that exist.

The mutation run itself takes about 25 minutes and is opt-in (tests/test_mutation_check.py); this takes a second,
so it runs with the suite: a refactor that moves a broken line would otherwise leave its mutation pointing at
nothing until someone runs the check.
"""

import importlib.util

from tests.launch import REPO


def load_breaks() -> list:
    spec = importlib.util.spec_from_file_location("mutation_check", REPO / "scripts" / "mutation_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.BREAKS


def test_every_break_names_a_line_that_occurs_once_and_tests_that_exist():
    for b in load_breaks():
        count = (REPO / b.file).read_text().count(b.old) if (REPO / b.file).exists() else 0
        assert count == 1, f"mutation '{b.name}': its old text occurs {count} times in {b.file}: {b.old!r}"
        for test in b.tests:
            path = REPO / test.split("::")[0]
            assert path.exists(), f"mutation '{b.name}': its test file {path} does not exist"


def test_the_testing_page_counts_the_breaks():
    """docs/testing.md says how many breaks the check applies; a break added without the page follows fails here."""
    page = (REPO / "docs" / "testing.md").read_text(encoding="utf-8")
    assert f"({len(load_breaks())} today)" in page, "update the count of breaks in docs/testing.md"
