"""Test-suite-wide rules.

- Opt-in markers: the long runs (the full reshard matrix, every README block, the mutation check, every ZeRO
  parity case, the CPU benchmarks' quick modes, every cell of the Hugging Face support table, the jobs under a real
  Slurm, the 8B-shaped Hugging Face import, lm-evaluation-harness itself) run only when `-m` names their marker; any
  other run, including one with its own `-m "not slow"`, leaves them out.
- With TORCHPRE_REQUIRE_EXTRAS=1 (set by .ci/run, which installs every extra) a test that would skip because an
  optional package cannot be imported fails instead: a green CI must not hide an undeclared dependency.
- A test that leaves torch's default process group initialized (it timed out, or failed before its own teardown)
  fails, and the group is destroyed: one timeout costs one test, not every later test of its pytest worker that
  starts a group ("trying to initialize the default process group twice"). tests/test_conftest.py checks it.
- The suite must pass on a machine SLOWDOWN times slower than CI's idle one: every timeout is at least SLOWDOWN
  times what its test takes there. The summary lists the tests of this run that took more than 1 / SLOWDOWN of
  their timeout, the ones to shrink or give a longer timeout (on a loaded machine it lists more).
"""

import importlib
import os
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest

SLOWDOWN = 4
OPT_IN_MARKERS = (
    "matrix", "zero_matrix", "mutation", "readme", "plan_matrix", "bench", "hf_table", "parity_matrix", "security",
    "slurm", "big_import", "fuzz", "published_corpus", "lm_eval", "data_scale",
    "snapshot_matrix",
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


@pytest.fixture(autouse=True)
def no_leaked_process_group() -> Iterator[None]:
    """After each test: a default process group still initialized is destroyed, and the test that left it fails."""
    yield
    dist = sys.modules.get("torch.distributed")  # never imported: no group can exist (and torch stays unloaded)
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("the test left torch's default process group initialized (destroyed now)", pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Each report carries its test's timeout, for the summary (under xdist it is made in a worker)."""
    outcome = yield
    marker = item.get_closest_marker("timeout")
    timeout = marker.args[0] if marker and marker.args else item.config.getini("timeout")
    outcome.get_result().user_properties.append(("timeout", float(timeout or 0)))


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    """Lists the tests that a machine SLOWDOWN times slower would time out (see the module docstring)."""
    close = []
    for report in terminalreporter.getreports("passed") + terminalreporter.getreports("failed"):
        timeout = dict(report.user_properties).get("timeout", 0)
        if report.when == "call" and timeout and report.duration * SLOWDOWN > timeout:
            close.append(f"{report.duration:7.1f} s of {timeout:.0f} s  {report.nodeid}")
    if close:
        terminalreporter.write_sep("=", f"tests within {SLOWDOWN}x of their timeout")
        for line in sorted(close, reverse=True):
            terminalreporter.write_line(line)
