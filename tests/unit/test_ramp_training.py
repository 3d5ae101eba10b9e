"""A ramped job on one process, step by step: each step reads its own global batch (as more microbatches), its loss
is the mean token cross-entropy over that batch (not over the final one), the data position advances by it, and
MoE's auxiliary loss is scaled by it."""

import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from torchpre.config.job_config import JobConfig
from torchpre.config.parser import parse_args
from torchpre.distributed.process_groups import shutdown_distributed
from torchpre.training.trainer import Trainer


def test_each_step_of_a_ramp_is_the_mean_over_its_own_batch_and_advances_the_data_by_it(tmp_path: Path) -> None:
    """"2,2,4" up to 6 at a local batch of 2: batches of 2, 4, 6 sequences (2 samples per increment), as 1, 2 and 3
    microbatches. The loss of each is compared with a plain forward of the same sequences (fp32, one process: the
    sums differ only in order, measured 4.8e-7 at most)."""
    config = parse_args(JobConfig, [
        "--model.flavor", "tiny", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--training.global_batch_size", "6", "--training.batch_rampup", "2,2,4", "--training.steps", "3",
        "--job.dump_folder", str(tmp_path),
    ])  # fmt: skip
    try:
        trainer = Trainer(config)
        job = trainer.job
        counts, positions, batches = [], [], []
        for _ in range(3):
            shape = job.begin_step()
            microbatches = job.data.next_step()
            loss = trainer.forward_backward(microbatches)
            inputs = torch.cat([x for x, _ in microbatches])
            labels = torch.cat([y for _, y in microbatches])
            with torch.no_grad():
                logits = job.model.parts[0](inputs)
            expected = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
            torch.testing.assert_close(loss, expected, rtol=0, atol=1e-6)
            trainer.drop_gradients()
            job.progress.step += 1
            job.data.step_done()
            counts.append(len(microbatches))
            positions.append(job.data.consumed_samples)
            batches.append(shape.sizes.global_batch_size)
        assert batches == [2, 4, 6]
        assert counts == [1, 2, 3]
        assert positions == [2, 6, 12]
        assert job.progress.state_dict()["global_batch_size"] == 6
    finally:
        shutdown_distributed()


def test_the_moe_auxiliary_loss_follows_the_ramps_batch(tmp_path: Path) -> None:
    """MoE's load-balancing loss is a mean over the global batch's sequences (`set_aux_loss_scale`): under a ramp its
    scale is 1 / the step's batch, 1/2, 1/4 and 1/6 here."""
    config = parse_args(JobConfig, [
        "--model.name", "moe", "--model.flavor", "tiny", "--training.seq_len", "32", "--training.local_batch_size",
        "2", "--training.global_batch_size", "6", "--training.batch_rampup", "2,2,4", "--training.steps", "3",
        "--job.dump_folder", str(tmp_path),
    ])  # fmt: skip
    try:
        job = Trainer(config).job
        scales = []
        for batch in (2, 4, 6):
            job.begin_step()
            scales.append({moe.aux_loss_scale for moe in job.model.parts[0].moe_layers()})
            job.progress.step += 1
            job.data.consumed_samples += batch
        assert scales == [{1 / 2}, {1 / 4}, {1 / 6}]
    finally:
        shutdown_distributed()


def test_the_trainer_warns_at_start_up_of_a_ramp_over_no_samples(tmp_path: Path, caplog) -> None:
    """`StepPlan.warnings` reach the log once the job is built (tests/unit/test_step_plan.py has their cases)."""
    config = parse_args(JobConfig, [
        "--model.flavor", "tiny", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--training.global_batch_size", "6", "--training.batch_rampup", "2,2,0", "--training.steps", "3",
        "--job.dump_folder", str(tmp_path),
    ])  # fmt: skip
    try:
        with caplog.at_level(logging.WARNING, logger="torchpre"):
            Trainer(config)
    finally:
        shutdown_distributed()
    assert [r.getMessage() for r in caplog.records if "ramps over 0 samples" in r.getMessage()]
