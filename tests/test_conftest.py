"""The suite-wide rules of tests/conftest.py, checked on a pytest run of their own: a test that leaks torch's default
process group, on purpose or by timing out inside it, fails alone, and the tests after it in the same process start
their own groups and pass."""

import shutil
import subprocess
import sys
from xml.etree import ElementTree

from tests.launch import REPO

TESTS = '''
import time

import pytest
import torch.distributed as dist


def start_a_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def test_1_leaks_a_group():
    start_a_group()


def test_2_starts_its_own_group():
    start_a_group()
    dist.destroy_process_group()


@pytest.mark.timeout(2)
def test_3_times_out_holding_a_group():
    start_a_group()
    time.sleep(60)


def test_4_starts_its_own_group_after_a_timeout():
    start_a_group()
    dist.destroy_process_group()
'''


def test_a_leaked_process_group_fails_the_test_that_leaked_it_only(tmp_path):
    shutil.copy(REPO / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_leaks.py").write_text(TESTS)
    subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--junitxml", "report.xml", "test_leaks.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    outcomes: dict[str, list[str]] = {}
    for case in ElementTree.parse(tmp_path / "report.xml").getroot().iter("testcase"):  # a teardown error: its own
        outcomes.setdefault(case.get("name"), []).extend(
            f"{child.tag}: {child.get('message')}" for child in case if child.tag in ("failure", "error")
        )
    leaked = "error: failed on teardown with \"Failed: the test left torch's default process group initialized"
    assert [name for name, problems in outcomes.items() if not problems] == [
        "test_2_starts_its_own_group", "test_4_starts_its_own_group_after_a_timeout"
    ]
    assert [problem[: len(leaked)] for problem in outcomes["test_1_leaks_a_group"]] == [leaked]
    timed_out = outcomes["test_3_times_out_holding_a_group"]
    assert timed_out[0].startswith("failure: Failed: Timeout (>2.0s) from pytest-timeout"), timed_out
    assert timed_out[1].startswith(leaked), timed_out
