"""The per-step losses and gradient norms of seven layouts, bitwise equal to values recorded before the trainer was
split into components (issue 33): a restructuring that claims to change no behaviour is held to the bit.

The recorded values are exact floats from metrics.jsonl (JSON keeps every bit of a double). A change that is
meant to move the numbers (a new reduction order, another init) reruns this file with TORCHPRE_RECORD_LOSSES=1,
which prints the new table instead of checking, and says why in its commit.
"""

import json
import os
import shutil

import pytest

from tests.launch import DEBUG, MOE_TINY, REPO, train_and_read_metrics

pytestmark = pytest.mark.slow

STEPS = ["--training.steps", "3", "--training.local_batch_size", "2", "--metrics.log_freq", "1"]

LAYOUTS = {
    "one-process": (1, [*DEBUG, *STEPS]),
    "dp2-zero1": (2, [*DEBUG, *STEPS, "--optimizer.zero_stage", "1"]),
    "dp2-zero3": (2, [*DEBUG, *STEPS, "--optimizer.zero_stage", "3"]),
    "tp2-sp": (
        2,
        [*DEBUG, *STEPS, "--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_sequence_parallel"],
    ),
    # parallelism.sequence_parallel_save_shard gathers the same shard again in backward: tp2-sp's numbers, bitwise.
    "tp2-sp-save-shard": (
        2,
        [*DEBUG, *STEPS, "--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_sequence_parallel",
         "--parallelism.sequence_parallel_save_shard"],
    ),
    # activation_checkpoint.recompute_mlp_activation recomputes each MLP's activation with the same ops, inside the
    # same saved-tensor hooks as the shard's gather: tp2-sp's numbers, bitwise.
    "tp2-sp-save-shard-mlp-recompute": (
        2,
        [*DEBUG, *STEPS, "--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_sequence_parallel",
         "--parallelism.sequence_parallel_save_shard", "--activation_checkpoint.recompute_mlp_activation"],
    ),
    "pp2-1f1b": (
        2,
        [*DEBUG, *STEPS, "--parallelism.pipeline_parallel_degree", "2",
         "--parallelism.pipeline_parallel_schedule", "1F1B"],
    ),
    "moe-ep2": (
        2,
        [*MOE_TINY, "--training.steps", "3", "--metrics.log_freq", "1", "--parallelism.expert_parallel_degree", "2"],
    ),
}  # fmt: skip

# (loss, grad_norm) per step, recorded on main at 0a62600 (before the split), and again when the sample order
# became version 2 (sampler.FeistelShuffle, issue 66), which draws other samples into each batch.
RECORDED: dict[str, list[tuple[float, float]]] = {
    "one-process": [(8.111013412475586, 2.135202407836914), (7.948271751403809, 2.376828908920288),
                   (8.191143989562988, 2.149273157119751)],
    "dp2-zero1": [(8.032632827758789, 1.6064752340316772), (8.170923233032227, 1.528647541999817),
                 (8.071196556091309, 1.6877572536468506)],
    "dp2-zero3": [(8.032632827758789, 1.6064752340316772), (8.170923233032227, 1.528647541999817),
                 (8.071196556091309, 1.6877572536468506)],
    "tp2-sp": [(8.111013412475586, 2.135202407836914), (7.948271751403809, 2.376828908920288),
              (8.191143989562988, 2.149273157119751)],
    "tp2-sp-save-shard": [(8.111013412475586, 2.135202407836914), (7.948271751403809, 2.376828908920288),
                         (8.191143989562988, 2.149273157119751)],
    "tp2-sp-save-shard-mlp-recompute": [(8.111013412475586, 2.135202407836914), (7.948271751403809, 2.376828908920288),
                                       (8.191143989562988, 2.149273157119751)],
    "pp2-1f1b": [(8.111013412475586, 2.135202407836914), (7.948271751403809, 2.376828908920288),
                (8.191143989562988, 2.149273157119751)],
    "moe-ep2": [(8.125028610229492, 0.4200839698314667), (8.107759475708008, 0.43123531341552734),
               (8.120843887329102, 0.427761048078537)],
}  # fmt: skip


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_losses_and_grad_norms_are_bitwise_the_recorded_ones(layout, tmp_path):
    nproc, args = LAYOUTS[layout]
    records = train_and_read_metrics(args, nproc, tmp_path)
    measured = [(r["loss"], r["grad_norm"]) for r in records]
    if os.environ.get("TORCHPRE_RECORD_LOSSES") == "1":
        print(f"\nRECORDED {json.dumps({layout: measured})}")
        return
    assert measured == RECORDED[layout], f"{layout}: {measured} != recorded {RECORDED[layout]}"


# A checkpoint written by main at 0a62600, before the trainer's components owned their state (step 2 of the run
# below), and the records of steps 3-5 of that uninterrupted run: a resume from it must continue bitwise.
OLD_CHECKPOINT = REPO / "tests" / "fixtures" / "checkpoint_0a62600" / "step-2"
OLD_RUN = [
    "--model.flavor", "tiny", "--model.vocab_size", "256", "--training.dataset", "synthetic",
    "--training.seq_len", "32", "--training.local_batch_size", "4", "--training.steps", "5",
    "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.min_lr_factor", "0.1", "--metrics.log_freq", "1",
    "--checkpoint.enable", "--checkpoint.interval", "2",
]  # fmt: skip
# (step, loss, grad_norm, lr)
OLD_RUN_RECORDS = [
    (3, 6.006145000457764, 0.7319775819778442, 0.0005600000000000001),
    (4, 6.083770751953125, 0.7378087639808655, 0.00032),
    (5, 6.094520568847656, 0.7346978187561035, 8e-05),
]


def test_a_checkpoint_written_before_the_split_resumes_bitwise(tmp_path):
    shutil.copytree(OLD_CHECKPOINT, tmp_path / "checkpoint" / "step-2")
    records = train_and_read_metrics(OLD_RUN, 1, tmp_path)
    assert [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in records] == OLD_RUN_RECORDS
