"""Bad input stops every rank quickly with one message that names the key or file and the fix."""

import pytest

from tests.launch import TINY, run_train

pytestmark = pytest.mark.slow


def assert_clean_failure(result, *fragments: str) -> None:
    """Non-zero exit, the fragments in the message, and no frame of our code (torchrun's own launcher
    traceback, printed whenever a worker fails, is allowed)."""
    assert result.returncode != 0, result.stdout
    assert "train.py\", line" not in result.stderr and "/torchpre/" not in result.stderr, result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, f"{fragment!r} not in:\n{result.stderr}"


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--training.stepz", "3"], ["training.stepz", "command line", "training.steps"]),
        (["--training.steps", "many"], ["training.steps", "int", "many"]),
        (["--job.config_file", "no/such.toml"], ["no/such.toml"]),
        (["--model.tokenizer_path", "no/such.model"], ["no/such.model", "model.tokenizer_path"]),
        (
            ["--training.dataset", "text", "--training.dataset_path", "no/such.jsonl"],
            ["no/such.jsonl", "does not exist"],
        ),
        (["--training.local_batch_size", "0"], ["training.local_batch_size = 0"]),
        (["--training.global_batch_size", "6"], ["global_batch_size = 6", "local_batch_size"]),
        (["--model.flavor", "debugmodell"], ["model.flavor", "debugmodel"]),
        (["--checkpoint.initial_load_path", "no/such/step-5"], ["checkpoint.initial_load_path", "no/such/step-5"]),
        (["--checkpoint.exclude_from_loading", "optimiser"], ["exclude_from_loading", "optimiser"]),
        (["--optimizer.zero_stage", "2"], ["optimizer.zero_stage = 2"]),
    ],
)
def test_single_process_bad_input(args, fragments, tmp_path):
    assert_clean_failure(run_train([*TINY, *args], 1, tmp_path, timeout=60), *fragments)


def test_unknown_key_in_the_toml_file_names_the_file(tmp_path):
    config = tmp_path / "job.toml"
    config.write_text("[training]\nsteps = 2\nlocal_batch = 4\n")
    result = run_train(["--job.config_file", str(config)], 1, tmp_path, timeout=60)
    assert_clean_failure(result, "training.local_batch", str(config), "training.local_batch_size")


def test_empty_dataset(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    args = [*TINY, "--training.dataset", "text", "--training.dataset_path", str(empty)]
    result = run_train(args, 1, tmp_path, timeout=60)
    assert_clean_failure(result, str(empty), "no text")


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--parallelism.data_parallel_degree", "3"], ["3 x 1 x 1 = 3", "2 launched"]),
        (["--training.global_batch_size", "12"], ["global_batch_size = 12"]),
        (
            [
                "--training.local_batch_size", "2",
                "--parallelism.pipeline_parallel_degree", "2",
                "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble",
            ],
            ["'ZBVZeroBubble' schedule needs at least as many microbatches as stages (4)"],
        ),
        (
            ["--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_sequence_parallel"]
            + ["--training.seq_len", "33"],
            ["training.seq_len = 33"],
        ),
        (
            ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_virtual_stages", "2"]
            + ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"],
            ["2 layers, fewer than the 4 pipeline stages"],
        ),
    ],
)
def test_every_rank_exits_on_a_bad_layout(args, fragments, tmp_path):
    result = run_train([*TINY, *args], 2, tmp_path, timeout=90)
    assert_clean_failure(result, *fragments)
    assert result.stderr.count("error (rank") == 2
    assert "error_file: <N/A>" not in result.stderr  # torchrun's summary shows our message
