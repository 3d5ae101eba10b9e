"""Every deliberate break of a core mechanism in scripts/mutation_check.py is caught by its tests.

About 25 minutes, so it runs only when asked for (`python -m pytest -m mutation`; tests/conftest.py deselects the
opt-in markers otherwise).
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
