"""`train.py --model.name hf`: transformers models trained as they are. For two model types (Llama, and Qwen2
with q/k/v biases and tied embeddings), the per-step losses of tp2 (+SP, +loss parallel), pp2 and dp2 x tp2 equal
one process's, a pp2 checkpoint resumes under tp2 on the same trajectory, and its export loads with
`from_pretrained` to the same logits; greedy generation from it matches transformers' own `generate`. Gemma (its
embedding scale is a buffer, its norms start at 0) trains under dp2 ZeRO-1 as in one process, and architectures
beyond the Llama layout (GPT-2's Conv1D and tied embeddings, Gemma, Qwen2-MoE's experts) export and import.
docs/hf-models.md (tests/integration/test_hf_support_table.py) covers every architecture and layout."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.launch import REPO, read_checkpoint, run_entry, train_and_read_metrics, train_and_read_params
from torchpre.config.job_config import JobConfig
from torchpre.config.parser import parse_args
from torchpre.models.hf import HFCausalLM, hf_args
from torchpre.models.hf.tiny import default_tiny_config

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

CONFIGS = {name: f"assets/hf_configs/{name}_tiny.json" for name in ("llama", "qwen2", "qwen3")}
STEPS, SAVE_AT = 4, 2


def job(model_type: str, *extra: str, config: Path | None = None) -> list[str]:
    return [
        "--job.config_file", "train_configs/debug_model.toml",
        "--model.name", "hf",
        "--model.hf_config", str(config or REPO / CONFIGS[model_type]),
        "--training.seq_len", "32",
        "--training.global_batch_size", "8",
        "--training.local_batch_size", "4",
        "--training.steps", str(STEPS),
        "--lr_scheduler.warmup_steps", "2",
        "--metrics.log_freq", "1",
        *extra,
    ]  # fmt: skip


TP2 = ["--parallelism.tensor_parallel_degree", "2"]
SP_LP = ["--parallelism.enable_sequence_parallel", "--parallelism.enable_loss_parallel"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B"]
CKPT = ["--checkpoint.enable", "--checkpoint.interval", str(SAVE_AT)]
LAYOUTS = {
    "tp2_sp_lp": (2, [*TP2, *SP_LP]),
    "pp2_1f1b": (2, PP2),
    "dp2_tp2_zero1": (4, [*TP2, "--optimizer.zero_stage", "1"]),
}
# fp32 on CPU: the layouts differ from one process only in reduction order (TP partial sums, microbatch and DP
# sums), ~1e-6 on the loss after a few AdamW steps; a wrong or missing term moves it by 1e-2 or more.
LOSS_ATOL = 1e-4
# The export holds the trained fp32 weights bitwise; transformers' forward and HFCausalLM's run the same modules
# with the same rotary tables and causal attention, so only kernel choice can differ (~1e-7).
LOGITS_ATOL = 1e-5


def losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_type(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def reference(model_type, tmp_path_factory) -> list[dict]:
    records = train_and_read_metrics(job(model_type), 1, tmp_path_factory.mktemp(f"{model_type}_one"))
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert losses(records)[-1] < losses(records)[0]
    return records


@pytest.fixture(scope="module")
def pipelined(model_type, tmp_path_factory) -> tuple[Path, list[dict]]:
    """A pp2 run that saves checkpoints: its folder and records."""
    folder = tmp_path_factory.mktemp(f"{model_type}_pp2")
    return folder, train_and_read_metrics(job(model_type, *PP2, *CKPT), 2, folder)


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "pp2_1f1b"])
def test_layouts_match_one_process(model_type, reference, layout, tmp_path):
    nproc, args = LAYOUTS[layout]
    records = train_and_read_metrics(job(model_type, *args), nproc, tmp_path)
    assert losses(records) == pytest.approx(losses(reference), abs=LOSS_ATOL)


@pytest.mark.parametrize("model_type", ["qwen2"], indirect=True)  # one type: compile's cost is ~20 s per graph
def test_compiled_checkpointed_decoder_layers_train_the_same(model_type, reference, tmp_path):
    """torch.compile and per-op selective activation checkpointing per decoder layer (transformers' module, whole
    graphs: fullgraph) change no loss beyond kernel rounding."""
    records = train_and_read_metrics(
        job(model_type, "--compile.enable", "--activation_checkpoint.mode", "selective"), 1, tmp_path
    )
    assert losses(records) == pytest.approx(losses(reference), abs=LOSS_ATOL)


def test_per_head_norms_are_summed_over_tensor_parallel_ranks(tmp_path):
    """Qwen3 normalises each query and key head with one shared weight: a tp rank holds half the heads, so that
    weight's gradient is a partial sum the plan must add over the ranks. Without it the two ranks' copies part
    (train_and_read_params requires them bitwise equal) and leave one process's weights."""
    _, one = train_and_read_params(job("qwen3"), 1, tmp_path / "one")
    records, tp2 = train_and_read_params(job("qwen3", *TP2, *SP_LP), 2, tmp_path / "tp2")
    assert len(records) == STEPS
    assert tp2.keys() == one.keys()
    for name, value in tp2.items():
        # AdamW normalises each gradient, so reduction-order noise in a near-zero one shows (~1e-5, as in
        # tests/distributed/test_parallelize_api.py); a missing term moves a weight by ~lr = 2e-3 per step.
        torch.testing.assert_close(value, one[name], rtol=0, atol=1e-4, msg=name)


def test_pp2_matches_one_process_and_resumes_under_tp2(model_type, reference, pipelined, tmp_path):
    folder, records = pipelined
    assert losses(records) == pytest.approx(losses(reference), abs=LOSS_ATOL)
    shutil.copytree(folder / "checkpoint" / f"step-{SAVE_AT}", tmp_path / "checkpoint" / f"step-{SAVE_AT}")
    resumed = train_and_read_metrics(job(model_type, *TP2, *SP_LP, *CKPT), 2, tmp_path)
    assert [r["step"] for r in resumed] == list(range(SAVE_AT + 1, STEPS + 1))
    assert losses(resumed) == pytest.approx(losses(reference)[SAVE_AT:], abs=LOSS_ATOL)


def test_export_loads_with_from_pretrained_and_imports_back(model_type, pipelined, tmp_path):
    folder, _ = pipelined
    step_dir, hf_dir, back_dir = folder / "checkpoint" / f"step-{STEPS}", tmp_path / "hf", tmp_path / "back" / "step-0"
    convert("dcp-to-hf", step_dir, hf_dir, model_type)
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["model_type"] == model_type
    trained = read_checkpoint(step_dir)["model"]
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    for name, tensor in hf_model.state_dict().items():
        expected = trained.get(name, trained["model.embed_tokens.weight"] if name == "lm_head.weight" else None)
        assert torch.equal(tensor, expected), name
    ids = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf_model(ids).logits, torchpre_logits(model_type, trained, ids), rtol=0,
                                   atol=LOGITS_ATOL)

    convert("hf-to-dcp", hf_dir, back_dir, model_type)
    back = read_checkpoint(back_dir)["model"]
    for name, tensor in trained.items():
        assert torch.equal(back[name], tensor), name


def test_a_folder_saved_by_transformers_imports(tmp_path):
    """Weights a user has, as `save_pretrained` writes them (tied: no lm_head.weight), become a checkpoint that
    holds them exactly, to start from with --checkpoint.initial_load_path."""
    config = transformers.AutoConfig.from_pretrained(REPO / CONFIGS["qwen2"])
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    theirs.save_pretrained(tmp_path / "hf")
    convert("hf-to-dcp", tmp_path / "hf", tmp_path / "imported" / "step-0", "qwen2")
    imported = read_checkpoint(tmp_path / "imported" / "step-0")["model"]
    assert imported.keys() == theirs.state_dict().keys()
    for name, tensor in theirs.state_dict().items():
        assert torch.equal(imported[name], tensor), name


@pytest.mark.parametrize("model_type", ["qwen2"], indirect=True)  # one type: generation runs the trained forward
def test_generation_matches_transformers_generate(pipelined, model_type, tmp_path):
    """`torchpre.generate` under pp2 decodes greedily what transformers' `generate` decodes from the export."""
    folder, _ = pipelined
    convert("dcp-to-hf", folder / "checkpoint" / f"step-{STEPS}", tmp_path / "hf", model_type)
    prompt = "def main():"
    result = run_entry(
        "torchpre.generate",
        [*job(model_type, *PP2), "--job.dump_folder", str(folder), "--prompt", prompt, "--max_new_tokens", "8",
         "--temperature", "0", "--json"],
        nproc=2,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(result.stdout.strip().splitlines()[-1])
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    prompt_ids = torch.tensor([record["prompt_token_ids"]])
    mask = torch.ones_like(prompt_ids)
    expected = hf_model.generate(prompt_ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    expected_ids = expected[0, prompt_ids.shape[1] :].tolist()
    eos = json.loads((tmp_path / "hf" / "generation_config.json").read_text())["eos_token_id"]
    expected_ids = expected_ids[: expected_ids.index(eos)] if eos in expected_ids else expected_ids
    assert record["token_ids"] == expected_ids
    assert len(expected_ids) >= 4, "decoding stopped at once: the comparison would say little"


def convert(command: str, source: Path, target: Path, model_type: str, config: Path | None = None) -> None:
    result = run_entry("torchpre.convert", [command, str(source), str(target), *job(model_type, config=config)])
    assert result.returncode == 0, result.stderr[-3000:]


def torchpre_logits(
    model_type: str, state_dict: dict[str, torch.Tensor], ids: torch.Tensor, config: Path | None = None
) -> torch.Tensor:
    """The logits of torchpre's HFCausalLM (the module the trainer trains) with `state_dict`."""
    args = hf_args(parse_args(JobConfig, job(model_type, config=config)), 2048, None)
    model = HFCausalLM(args)
    model.load_state_dict(state_dict, strict=False)
    with torch.no_grad():
        return model(ids)


def tiny_config_file(model_type: str, folder: Path) -> Path:
    """The tiny version of `model_type`'s default config (no dropout), as a config.json for train.py."""
    path = folder / f"{model_type}.json"
    path.write_text(default_tiny_config(model_type).to_json_string())
    return path


def test_gemma_under_dp2_zero1_matches_one_process(tmp_path):
    """Gemma multiplies its embeddings by a buffer (sqrt(hidden_size)) and its RMSNorm by (1 + weight): both must be
    what transformers makes them on every rank. An uninitialised buffer (as before: 1e-4 on one rank, 1e31 on the
    other) moved the losses by 1.27."""
    config = tiny_config_file("gemma", tmp_path)
    one = train_and_read_metrics(job("gemma", config=config), 1, tmp_path / "one")
    dp2 = train_and_read_metrics(job("gemma", "--optimizer.zero_stage", "1", config=config), 2, tmp_path / "dp2")
    assert losses(dp2) == pytest.approx(losses(one), abs=LOSS_ATOL)


@pytest.mark.parametrize("model_type", ["gpt2", "gemma", "qwen2_moe"])
def test_other_architectures_export_and_import(model_type, tmp_path):
    """A checkpoint of an architecture beyond the Llama layout exports to a folder `from_pretrained` loads, with
    torchpre's logits, and imports back bitwise."""
    config = tiny_config_file(model_type, tmp_path)
    train_and_read_metrics(job(model_type, "--training.steps", "2", *CKPT, config=config), 1, tmp_path / "run")
    step_dir, hf_dir, back_dir = tmp_path / "run/checkpoint/step-2", tmp_path / "hf", tmp_path / "back/step-0"
    for command, source, target in (("dcp-to-hf", step_dir, hf_dir), ("hf-to-dcp", hf_dir, back_dir)):
        convert(command, source, target, model_type, config)
    trained = read_checkpoint(step_dir)["model"]
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    assert json.loads((hf_dir / "config.json").read_text())["model_type"] == hf_model.config.model_type == model_type
    ids = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf_model(ids).logits, torchpre_logits(model_type, trained, ids, config), rtol=0,
                                   atol=LOGITS_ATOL)
    back = read_checkpoint(back_dir)["model"]
    assert back.keys() == trained.keys()
    for name, tensor in trained.items():
        assert torch.equal(back[name], tensor), name
