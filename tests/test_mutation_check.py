"""Every deliberate break of a core mechanism in scripts/mutation_check.py is caught by its tests.

About 25 minutes, so deselected by default (pyproject's addopts) and marked slow too, which keeps it out of a
run whose own `-m` replaces the default: `python -m pytest -m mutation` runs it.
"""

import subprocess
import sys

import pytest

from tests.launch import REPO

pytestmark = [pytest.mark.mutation, pytest.mark.slow]


@pytest.mark.timeout(3600)
def test_every_break_is_caught():
    result = subprocess.run(
        [sys.executable, "scripts/mutation_check.py"], cwd=REPO, capture_output=True, text=True, timeout=3600
    )
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
