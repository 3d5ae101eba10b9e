"""Shared pytest set-up.

With TORCHPRE_REQUIRE_EXTRAS=1 (set by .ci/run, which installs every extra) a test that would skip because an
optional package cannot be imported fails instead: a green CI must not hide an undeclared dependency.
"""

import importlib
import os
from types import ModuleType

import pytest


def _import_or_fail(modname: str, *args: object, **kwargs: object) -> ModuleType:
    """`pytest.importorskip` that raises the ImportError: every extra is installed, so nothing may be missing."""
    return importlib.import_module(modname)


if os.environ.get("TORCHPRE_REQUIRE_EXTRAS") == "1":
    pytest.importorskip = _import_or_fail
