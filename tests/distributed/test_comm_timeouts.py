"""comm.init_timeout_seconds bounds every wait for a peer during start-up and the first step, comm.timeout_seconds
every wait after it, on every group a rank holds: the world, the mesh's sub-groups, the checkpoint's background
group (2 gloo processes, the trainer built as train.py builds it). The end-to-end hang is
tests/integration/test_faults.py::test_a_hung_peer_fails_the_job_within_comm_timeout."""

import json
import os
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torchpre.config.job_config import JobConfig
from torchpre.config.parser import parse_args
from torchpre.distributed.process_groups import shutdown_distributed
from torchpre.training.trainer import Trainer

pytestmark = pytest.mark.slow

INIT_S, TRAIN_S = 77.0, 33.0


def group_timeouts(trainer: Trainer) -> dict[str, float]:
    """The timeout of each group the trainer's collectives run on, read back from its gloo backend."""
    groups = {"world": dist.group.WORLD, "async checkpoint": trainer.job.checkpoint.async_group}
    groups |= {f"mesh {name}": trainer.job.mesh[name].get_group() for name in trainer.job.mesh.mesh_dim_names}
    cpu = torch.device("cpu")
    return {name: group._get_backend(cpu).options._timeout.total_seconds() for name, group in groups.items()}


class ProbedTrainer(Trainer):
    """Records the timeouts in force when each step starts."""

    def train_step(self, microbatches, stop_requested=False):
        self.seen.append(group_timeouts(self))
        return super().train_step(microbatches, stop_requested)


def _worker(rank: int, port: int, folder: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    os.environ.update(MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    config = parse_args(JobConfig, [
        "--model.flavor", "tiny", "--training.seq_len", "16", "--training.local_batch_size", "2",
        "--training.steps", "3", "--metrics.peak_flops", "1e12", "--job.dump_folder", folder,
        "--parallelism.tensor_parallel_degree", "2", "--checkpoint.enable", "--checkpoint.async_mode", "async",
        "--checkpoint.interval", "1000", "--comm.init_timeout_seconds", str(INIT_S),
        "--comm.timeout_seconds", str(TRAIN_S),
    ])
    try:
        trainer = ProbedTrainer(config)
        trainer.seen = [group_timeouts(trainer)]
        trainer.train()
        trainer.seen.append(group_timeouts(trainer))
        Path(folder, f"rank{rank}.json").write_text(json.dumps(trainer.seen))
    finally:
        shutdown_distributed()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_the_start_up_timeout_holds_until_the_first_step_is_done_then_the_training_one(tmp_path):
    context = mp.start_processes(
        _worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=False, start_method="forkserver"
    )
    deadline = time.monotonic() + 180
    while not context.join(timeout=max(deadline - time.monotonic(), 0)):
        if time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("the 2-process job did not finish within 180 s")
    for rank in range(2):
        start, step1, step2, step3, end = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert start.keys() == {"world", "async checkpoint", "mesh pp", "mesh dp", "mesh tp"}
        assert start == step1 == dict.fromkeys(start, INIT_S), rank  # after start-up, as step 1 starts
        assert step2 == step3 == end == dict.fromkeys(start, TRAIN_S), rank  # once step 1 is done
