"""Test-suite-wide rules.

- Opt-in markers: the long runs (the full reshard matrix, every README block, the mutation check, every ZeRO
  parity case, the CPU benchmarks' quick modes, every cell of the Hugging Face support table, the jobs under a real
  Slurm, the 8B-shaped Hugging Face import) run only when `-m` names their marker; any other run, including one with
  its own `-m "not slow"`, leaves them out.
- With TORCHPRE_REQUIRE_EXTRAS=1 (set by .ci/run, which installs every extra) a test that would skip because an
  optional package cannot be imported fails instead: a green CI must not hide an undeclared dependency.
"""

import importlib
import os
from types import ModuleType

import pytest

OPT_IN_MARKERS = (
    "matrix", "zero_matrix", "mutation", "readme", "plan_matrix", "bench", "hf_table", "parity_matrix", "security",
    "slurm", "big_import",
)  # fmt: skip


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    named = config.getoption("markexpr") or ""
    left_out = [m for m in OPT_IN_MARKERS if m not in named]
    deselected = [item for item in items if any(item.get_closest_marker(m) for m in left_out)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if item not in deselected]


def _import_or_fail(modname: str, *args: object, **kwargs: object) -> ModuleType:
    """`pytest.importorskip` that raises the ImportError: every extra is installed, so nothing may be missing."""
    return importlib.import_module(modname)


if os.environ.get("TORCHPRE_REQUIRE_EXTRAS") == "1":
    pytest.importorskip = _import_or_fail
