"""`python -m torchpre.plan --model.flavor from_hf`: a released folder planned from its config.json alone, number for
number as the flavor of the same shape (the folder written from that flavor by the family's own `hf_config`)."""

import dataclasses
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import REPO
from torchpre.errors import ConfigError
from torchpre.models.deepseek_v3 import hf as deepseek_hf
from torchpre.models.llama3 import hf as llama_hf
from torchpre.models.registry import get_flavor, get_model_spec
from torchpre.plan import main as plan_main

HF_CONFIG = {"llama3": llama_hf.hf_config, "deepseek_v3": deepseek_hf.hf_config}


@pytest.fixture(autouse=True)
def quiet():
    logging.getLogger("torchpre").setLevel(logging.WARNING)
    yield
    logging.getLogger("torchpre").setLevel(logging.INFO)


def released(folder: Path, family: str, flavor: str, vocab_size: int) -> Path:
    """A folder holding only the config.json of `flavor` (no weights: a model is planned before it is downloaded)."""
    args = dataclasses.replace(get_flavor(family, flavor), vocab_size=vocab_size)
    folder.mkdir()
    config = HF_CONFIG[family](args, bos_token_id=0, eos_token_id=1, torch_dtype="bfloat16")
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def planned(capsys, keys: list[str]) -> dict:
    plan_main([*keys, "--json"])
    return json.loads(capsys.readouterr().out)


def without_time(result: dict) -> dict:
    return {key: value for key, value in result.items() if key not in ("seconds", "model")}


@pytest.mark.parametrize(
    ("family", "flavor", "vocab_size", "layout"),
    [
        # Llama 3.1 8B's shape and vocabulary, 8 GPUs, ZeRO-3 with full AC: torchtitan's table-1 layout
        ("llama3", "8B", 128_256, ["--optimizer.zero_stage", "3", "--activation_checkpoint.mode", "full",
                                   "--training.local_batch_size", "1", "--gpus", "8"]),
        # DeepSeek-V3 lite's shape (MLA, bias-balanced routing, dense first blocks), experts over 8 of 16 GPUs, pp2
        ("deepseek_v3", "lite", 102_400, ["--parallelism.expert_parallel_degree", "8",
                                          "--parallelism.pipeline_parallel_degree", "2",
                                          "--parallelism.pipeline_parallel_schedule", "1F1B",
                                          "--parallelism.pipeline_parallel_microbatch_size", "1",
                                          "--training.local_batch_size", "4", "--gpus", "16"]),
    ],
)  # fmt: skip
def test_a_fixed_layout_of_a_released_folder_is_predicted_as_its_flavor(
    capsys, tmp_path, family, flavor, vocab_size, layout
):
    """Every number of `--fixed --json` (each rank's bytes by kind, the step's pieces, tokens/s, MFU) equal."""
    folder = released(tmp_path / f"released-{flavor}", family, flavor, vocab_size)
    job = ["--model.name", family, "--training.seq_len", "4096", "--training.global_batch_size", "32",
           "--gpu", "h100-80gb", "--fixed", *layout]  # fmt: skip
    from_folder = planned(capsys, [*job, "--model.flavor", "from_hf", "--checkpoint.initial_load_path", str(folder)])
    from_flavor = planned(capsys, [*job, "--model.flavor", flavor, "--model.vocab_size", str(vocab_size)])
    assert from_folder["model"] == f"{family} from_hf:released-{flavor}"
    assert without_time(from_folder) == without_time(from_flavor)
    assert from_folder["layouts"][0]["memory_gib"] > 1  # the model's own size, not a placeholder's
    assert f"from_hf:released-{flavor}" not in get_model_spec(family).flavors  # registered only while planning


def test_a_search_over_a_released_folder_ranks_as_its_flavor_in_forked_workers(capsys, tmp_path):
    """Two forked workers (they inherit the folder's flavor) in a new process, as a user's run (a process that has
    run autograd cannot fork workers): the same layouts as the flavor's, in the same order, the same numbers."""
    folder = released(tmp_path / "released-tiny", "llama3", "tiny", 2048)
    job = ["--training.seq_len", "32", "--training.global_batch_size", "8", "--gpus", "2", "--gpu", "a100-80gb",
           "--json"]  # fmt: skip
    run = subprocess.run([sys.executable, "-m", "torchpre.plan", *job, "--workers", "2", "--model.flavor", "from_hf",
                          "--checkpoint.initial_load_path", str(folder)], capture_output=True, text=True,
                         timeout=240, check=True, cwd=REPO)  # fmt: skip
    from_folder = json.loads(run.stdout)
    plan_main([*job, "--workers", "1", "--model.flavor", "tiny"])
    from_flavor = json.loads(capsys.readouterr().out)
    assert len({(layout["tp"], layout["pp"]) for layout in from_folder["layouts"]}) > 2
    assert without_time(from_folder) == without_time(from_flavor)


@pytest.mark.parametrize(
    ("keys", "says"),
    [
        ([], ["checkpoint.initial_load_path", "which is unset", "config.json is all the planner reads"]),
        (["--checkpoint.initial_load_path", "{d}/empty"], ["'{d}/empty', which has none"]),
        (["--checkpoint.initial_load_path", "{d}/released", "--model.n_layers", "4"],
         ["model.n_layers = 4", "takes the shape of the folder's config.json"]),
        (["--checkpoint.initial_load_path", "{d}/released", "--model.vocab_size", "4096"],
         ["model.vocab_size = 4096", "the folder's embedding has vocab_size = 2048 rows"]),
        (["--checkpoint.initial_load_path", "{d}/released", "--model.name", "moe"],
         ["model.name = 'moe'", "cannot read its args from a Hugging Face config.json"]),
    ],
    ids=["unset", "no-config-json", "shape-key", "vocab-size", "family-without-a-reader"],
)  # fmt: skip
def test_a_released_folder_the_planner_cannot_read_is_refused_by_key(tmp_path, keys, says):
    released(tmp_path / "released", "llama3", "tiny", 2048)
    (tmp_path / "empty").mkdir()
    keys = [k.replace("{d}", str(tmp_path)) for k in keys]
    with pytest.raises(ConfigError) as refused:
        plan_main(["--model.flavor", "from_hf", "--training.global_batch_size", "8", "--gpus", "2", *keys])
    for text in says:
        assert text.replace("{d}", str(tmp_path)) in str(refused.value)
