"""Continued pretraining of a released model with its own tokenizer, end to end: a Qwen3-shaped folder as
transformers saves it (tied, a vocabulary of 1,024 rows) with its tokenizer.json (byte-level BPE of 1,000 ids, no
BOS: Qwen's kind, scripts/tiny_tokenizer.py) -> `prepare --tokenizer FOLDER` -> training from the folder under dp2
ZeRO-3 on those shards, the folder's tokenizer the default -> `torchpre.generate` -> the export. The export's
tokenizer loads in transformers and encodes as the folder's, its model gives torchpre's logits, and generation's
ids are transformers' tokenizer's and greedy `generate`'s."""

import json
from pathlib import Path

import pytest
import torch

from scripts import tiny_tokenizer
from tests.launch import read_checkpoint, run_entry, run_train, train_and_read_metrics
from tests.tokenizer_texts import MIXED
from torchpre.config.job_config import JobConfig
from torchpre.config.parser import parse_args
from torchpre.data.corpus import stdlib_documents
from torchpre.models.hf import HFCausalLM, hf_args

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

QWEN3 = dict(
    vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=True,
)  # fmt: skip
STEPS = 2
# The export holds the trained fp32 weights bitwise; transformers' forward and HFCausalLM's run the same modules, so
# only kernel choice can differ (~1e-7; tests/integration/test_hf_models.py).
LOGITS_ATOL = 1e-5
PROMPT = "def main():\n    return"


def job(folder: Path, *extra: str) -> list[str]:
    """A job on the released folder with no model.tokenizer_path: the folder's own tokenizer is the default."""
    return [
        "--model.name", "hf", "--model.hf_config", str(folder), "--checkpoint.initial_load_path", str(folder),
        "--training.seq_len", "32", "--training.local_batch_size", "2", "--training.global_batch_size", "4",
        "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> Path:
    """The folder: random weights saved by transformers, and the tokenizer beside them."""
    folder = tmp_path_factory.mktemp("released") / "qwen3"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**QWEN3), dtype=torch.float32)
    model.save_pretrained(folder)
    tiny_tokenizer.write("byte_level", folder)
    return folder


@pytest.fixture(scope="module")
def trained(released, tmp_path_factory) -> Path:
    """prepare with the folder's tokenizer, then STEPS steps from the folder under dp2 ZeRO-3 on those shards, a
    checkpoint and an export at the last; returns the run's folder."""
    root = tmp_path_factory.mktemp("run")
    lines = [line.strip() for doc in stdlib_documents()[:40] for line in doc.splitlines() if line.strip()]
    (root / "text.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    result = run_entry("torchpre.data.prepare", [str(root / "text.jsonl"), "--output", str(root / "shards"),
                                                 "--tokenizer", str(released), "--workers", "1"])  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    train_and_read_metrics(job(
        released, "--training.dataset", "shards", "--training.dataset_path", str(root / "shards"),
        "--optimizer.zero_stage", "3", "--training.steps", str(STEPS), "--checkpoint.enable", "--checkpoint.interval",
        str(STEPS), "--hf_export.enable", "--hf_export.interval", str(STEPS), "--hf_export.async_mode", "disabled",
    ), 2, root / "dump")  # fmt: skip
    return root / "dump"


def test_shards_hold_the_released_tokenizers_ids_and_train_under_its_default(released, trained, tmp_path):
    """The shards are the folder's tokenizer's (Qwen's framing: the text, then EOS), and training read them
    without model.tokenizer_path; a run under another tokenizer is refused by the shards' hash."""
    reference = transformers.AutoTokenizer.from_pretrained(released)
    shards = trained.parent / "shards"
    manifest = json.loads((shards / "manifest.json").read_text())
    assert manifest["tokenizer_name"] == "qwen3" and manifest["vocab_size"] == 1000
    first = json.loads((trained.parent / "text.jsonl").read_text().splitlines()[0])["text"]
    offsets = torch.frombuffer(bytearray((shards / "shard_00000.idx").read_bytes()), dtype=torch.int64)
    tokens = torch.frombuffer(bytearray((shards / "shard_00000.bin").read_bytes()), dtype=torch.uint16)
    assert tokens[: offsets[1]].tolist() == reference(first)["input_ids"] + [reference.eos_token_id]
    metrics = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in metrics] == list(range(1, STEPS + 1))
    other = ["--model.tokenizer_path", str(tiny_tokenizer.write("unigram", tmp_path / "unigram")), "--training.steps",
             "1", "--training.dataset", "shards", "--training.dataset_path", str(shards)]  # fmt: skip
    result = run_train(job(released, *other), 1, tmp_path / "run")
    assert result.returncode == 2 and "made with tokenizer 'qwen3'" in result.stderr, result.stderr[-3000:]


def test_the_export_holds_the_tokenizer_and_the_model_transformers_load_as_torchpre_has_them(released, trained):
    export = trained / "hf" / f"step-{STEPS}"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (export / name).read_bytes() == (released / name).read_bytes(), name
    theirs, exported = (transformers.AutoTokenizer.from_pretrained(path) for path in (released, export))
    assert [exported(text)["input_ids"] for text in MIXED] == [theirs(text)["input_ids"] for text in MIXED]
    weights = read_checkpoint(trained / "checkpoint" / f"step-{STEPS}")["model"]
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    ids = torch.tensor([exported(text)["input_ids"][:32] for text in MIXED[1:4]])
    args = hf_args(parse_args(JobConfig, job(released)), 1000, None)
    model = HFCausalLM(args)
    model.load_state_dict(weights, strict=False)
    with torch.no_grad():
        torch.testing.assert_close(hf_model(ids).logits, model(ids), rtol=0, atol=LOGITS_ATOL)


def test_generation_encodes_and_decodes_with_the_released_tokenizer(released, trained):
    """The prompt's ids are transformers' tokenizer's, the greedy continuation is transformers' `generate` on the
    export, and the completion is its decoding."""
    result = run_entry("torchpre.generate", [
        *job(released), "--job.dump_folder", str(trained), "--prompt", PROMPT, "--max_new_tokens", "6",
        "--temperature", "0", "--json",
    ])  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(result.stdout.strip().splitlines()[-1])
    export = trained / "hf" / f"step-{STEPS}"
    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    assert record["prompt_token_ids"] == tokenizer(PROMPT)["input_ids"]
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    prompt = torch.tensor([record["prompt_token_ids"]])
    expected = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False)
    expected_ids = expected[0, prompt.shape[1] :].tolist()
    eos = tokenizer.eos_token_id
    assert record["token_ids"] == (expected_ids[: expected_ids.index(eos)] if eos in expected_ids else expected_ids)
    assert record["completion"] == tokenizer.decode(record["token_ids"])
