"""comm.trace_buf_size: the NCCL flight recorder's environment, set before any process group exists."""

import os
from pathlib import Path

import pytest

from torchpre.distributed.process_groups import (
    FLIGHT_RECORDER_FILE_VARIABLES,
    FLIGHT_RECORDER_SIZE_VARIABLES,
    configure_flight_recorder,
)

VARIABLES = (*FLIGHT_RECORDER_SIZE_VARIABLES, *FLIGHT_RECORDER_FILE_VARIABLES, "TORCH_NCCL_DUMP_ON_TIMEOUT")


@pytest.fixture
def environ(monkeypatch) -> dict:
    """os.environ without the recorder's variables; monkeypatch puts the real ones back after the test."""
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return os.environ


def test_a_buffer_records_and_dumps_to_the_traces_folder_on_timeout(environ, tmp_path: Path):
    folder = tmp_path / "run" / "comm_traces"
    configure_flight_recorder(2000, folder)
    assert environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == environ["TORCH_FR_BUFFER_SIZE"] == "2000"
    assert environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    for name in FLIGHT_RECORDER_FILE_VARIABLES:
        assert environ[name] == f"{folder}/rank_"  # torch appends the rank
    assert folder.is_dir()


def test_0_turns_the_recorder_off_and_writes_nothing(environ, tmp_path: Path):
    configure_flight_recorder(0, tmp_path / "comm_traces")
    assert environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == environ["TORCH_FR_BUFFER_SIZE"] == "0"  # torch's default: on
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT" not in environ
    assert not (tmp_path / "comm_traces").exists()


def test_the_config_wins_over_the_environment_and_says_so(environ, tmp_path: Path, caplog):
    environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] = "5"
    configure_flight_recorder(100, tmp_path)
    assert environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "100"
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE=5" in caplog.text
