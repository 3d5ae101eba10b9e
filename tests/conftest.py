"""Test-suite-wide collection rules."""

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The full reshard matrix (marker `matrix`: hours on 2 cores) runs only when `-m` names it, e.g.
    `-m matrix`: any other run, including one with its own `-m "not slow"`, leaves it out."""
    if "matrix" in (config.getoption("markexpr") or ""):
        return
    matrix = [item for item in items if item.get_closest_marker("matrix")]
    if matrix:
        config.hook.pytest_deselected(items=matrix)
        items[:] = [item for item in items if not item.get_closest_marker("matrix")]
