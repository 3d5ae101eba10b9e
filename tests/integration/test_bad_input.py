"""Bad input stops every rank quickly with one message that names the key or file and the fix.

The catalogue runs each case as a fresh process forked from one warm interpreter (tests/fork_server.py):
the same entry point, exit code and output as `python train.py ...`, without 2-3 s of Python and torch
start-up per case. Checks that run before the process group are played on every rank of a launch by
giving each forked process that rank's RANK/WORLD_SIZE, as torchrun would; a few cases launch real
torchrun workers, including one that fails after the process group is up.
"""

import dataclasses
import json
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from tests import foreign_cases
from tests.hf_folders import write_llama_folder
from tests.hostile import Payload, legacy_checkpoint, replace_metadata, rewrite_manifest
from tests.launch import REPO, TINY, ForkServer, add_manifest, manifest_record, run_train
from torchpre.checkpoint.integrity import MANIFEST
from torchpre.data.shards import Manifest, write_shard
from torchpre.data.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer
from torchpre.models.hf.tiny import default_tiny_config
from torchpre.models.llama3.args import LLAMA3_FLAVORS
from torchpre.models.llama3.model import Transformer

pytestmark = pytest.mark.slow

LIMIT_S = 60  # what a user waits, at most, to learn that the input is bad
EXIT_BAD_INPUT = 2


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ForkServer]:
    server = ForkServer(tmp_path_factory.mktemp("fork_server") / "server.log", timeout_s=LIMIT_S)
    yield server
    server.close()


# The bad files ---------------------------------------------------------------------------------------


def _write_shards(folder: Path, documents: list[list[int]], **manifest_fields) -> Path:
    folder.mkdir(parents=True)
    tokenizer = load_tokenizer(DEFAULT_TOKENIZER_PATH)
    shard = write_shard(folder, "part-0", documents, tokenizer.vocab_size)
    sha256 = tokenizer.sha256
    fields = {"tokenizer_sha256": sha256, "shards": [shard]} | manifest_fields
    Manifest(tokenizer_name=DEFAULT_TOKENIZER_PATH.name, vocab_size=tokenizer.vocab_size, **fields).write(folder)
    return folder


def _save_other_flavor_checkpoint(step_dir: Path) -> None:
    """The debug model's weights, which the tiny model the cases train cannot hold."""
    vocab_size = load_tokenizer(DEFAULT_TOKENIZER_PATH).vocab_size
    args = dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], vocab_size=vocab_size)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": model.state_dict()}, checkpoint_id=step_dir, no_dist=True)
    add_manifest(step_dir)


def _save_seq32_progress(step_dir: Path) -> None:
    """The "train" entry of a checkpoint trained with 4 sequences of 32 tokens per step, which is all that sizing a
    resumed job's global batch reads."""
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"train": {"step": 4, "global_batch_size": 4, "seq_len": 32}}, checkpoint_id=step_dir, no_dist=True)
    add_manifest(step_dir)


def _edit_json(path: Path, edit: Callable[[dict], None]) -> None:
    record = json.loads(path.read_text())
    edit(record)
    path.write_text(json.dumps(record))


def _copy_shards_with(good: Path, folder: Path, edit: Callable[[dict], None]) -> None:
    """A copy of the shard folder `good` whose manifest `edit` changed."""
    _edit_json(shutil.copytree(good, folder) / "manifest.json", edit)


def _tamper_with(step_dir: Path) -> None:
    """Writes the manifest a save would, then flips a byte of the data file as a bad disk or copy might."""
    files = {path.name: manifest_record(path) for path in sorted(step_dir.iterdir())}
    (step_dir / MANIFEST).write_text(json.dumps({"files": files}))
    with open(step_dir / "__0_0.distcp", "r+b") as data:
        data.seek(100)
        byte = data.read(1)
        data.seek(100)
        data.write(bytes([byte[0] ^ 0xFF]))


def _write_hf_folders(d: Path) -> None:
    """A released-looking Llama folder shaped like no flavor (3 layers), and copies of it broken one way each."""
    args = dataclasses.replace(LLAMA3_FLAVORS["tiny"], n_layers=3)
    write_llama_folder(d / "hf_llama", args)
    (weights,) = (d / "hf_llama").glob("model-*.safetensors")
    _edit_json(shutil.copytree(d / "hf_llama", d / "hf_unknown_field") / "config.json",
               lambda config: config.update(sliding_window=16))  # fmt: skip
    _edit_json(shutil.copytree(d / "hf_llama", d / "hf_small_vocab_folder") / "config.json",
               lambda config: config.update(vocab_size=1000))  # fmt: skip
    missing = shutil.copytree(d / "hf_llama", d / "hf_missing_tensor") / weights.name
    tensors = load_file(missing)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, missing)
    _edit_json(missing.parent / "model.safetensors.index.json",
               lambda index: index["weight_map"].pop("model.layers.1.mlp.up_proj.weight"))  # fmt: skip
    (shutil.copytree(d / "hf_llama", d / "hf_damaged") / weights.name).write_bytes(b"\x10\x00\x00\x00garbage")
    config = json.loads((d / "hf_llama" / "config.json").read_text())  # the same shapes, another model
    (d / "hf_llama_other_math.json").write_text(json.dumps(config | {"rope_theta": 10000.0, "rms_norm_eps": 1e-2}))
    outside = {"model.norm.weight": f"../hf_llama/{weights.name}"}
    _edit_json(shutil.copytree(d / "hf_llama", d / "hf_escaping_index") / "model.safetensors.index.json",
               lambda index: index["weight_map"].update(outside))  # fmt: skip


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """Every bad (and the few good) files the cases point at, made once; cases name them as {d}/NAME."""
    d = tmp_path_factory.mktemp("bad_files")
    (d / "unknown_section.toml").write_text("[trainin]\nsteps = 2\n")
    (d / "unknown_key.toml").write_text("[training]\nsteps = 2\nlocal_batch = 4\n")
    (d / "wrong_type.toml").write_text('[training]\nsteps = "ten"\n')
    (d / "malformed.toml").write_text("[training\nsteps = 2\n")
    (d / "stages_backwards.toml").write_text(
        "[training]\nsteps = 10\n[[training.data_stages]]\n[[training.data_stages]]\nstart_step = 6\n"
        "[[training.data_stages]]\nstart_fraction = 0.4\n"
    )
    (d / "a_file").write_text("not a folder\n")
    (d / "corrupt.model").write_text("this is not a tiktoken file\n")
    (d / "no_bytes.model").write_text("YQ== 0\n")  # one token, 'a': most bytes cannot be encoded
    (d / "empty.txt").write_text("\n")
    (d / "short.txt").write_text("hello world\n")
    sentence = "The quick brown fox jumps over the lazy dog. "
    (d / "text.txt").write_text(sentence * 300)
    (d / "non_string.jsonl").write_text('{"text": "fine"}\n{"text": 5}\n')
    (d / "not_utf8.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
    question = '{"context": "1, 2,", "choices": [" 3", " 4"], "answer": 0}\n'
    (d / "bad_json_task.jsonl").write_text(question + '{"context": "1, 2,", "choices": [" 3"\n')
    (d / "bad_answer_task.jsonl").write_text(question + question.replace('"answer": 0', '"answer": 2'))
    (d / "hf_not_json.json").write_text('{"model_type": "llama",\n "hidden_size": 64,,\n}\n')
    (d / "hf_gpt2.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2}))
    (d / "hf_bert.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 64}))
    for model_type in HF_REFUSED:  # tiny configs of architectures torchpre refuses some layouts of
        (d / f"hf_{model_type}.json").write_text(default_tiny_config(model_type).to_json_string())
    llama = json.loads((REPO / HF_LLAMA).read_text())
    (d / "hf_small_vocab.json").write_text(json.dumps(llama | {"vocab_size": 1000}))
    (d / "hf_llama_encoder_decoder.json").write_text(json.dumps(llama | {"is_encoder_decoder": True}))
    (d / "hf_unknown.json").write_text(json.dumps(llama | {"model_type": "llama9"}))
    for model_type in ("bart", "t5"):
        (d / f"hf_{model_type}.json").write_text(json.dumps({"model_type": model_type, "d_model": 64}))
    # Configs whose values, not their architecture, decide a layout (docs/hf-models.md's conditions).
    granite = json.loads(default_tiny_config("granite").to_json_string())
    (d / "hf_granite_multiplier.json").write_text(json.dumps(granite | {"embedding_multiplier": 12.0}))
    gemma3 = json.loads(default_tiny_config("gemma3_text").to_json_string())
    (d / "hf_gemma3_window.json").write_text(json.dumps(gemma3 | {"sliding_window": 16}))
    (d / "task.jsonl").write_text(question)
    (d / "not_utf8_task.jsonl").write_bytes(question.encode() + b'{"context": "caf\xe9", "choices": ["a", "b"], '
                                            b'"answer": 0}\n')

    ids = load_tokenizer(DEFAULT_TOKENIZER_PATH).encode(sentence * 20, bos=True, eos=True)
    good = _write_shards(d / "shards", [ids] * 10)
    truncated = shutil.copytree(good, d / "shards_truncated")
    with open(truncated / "part-0.bin", "r+b") as file:
        file.truncate(100)
    _write_shards(d / "shards_other_tokenizer", [ids], tokenizer_sha256="0" * 64)
    _write_shards(d / "shards_incomplete", [ids], complete=False)
    _write_shards(d / "shards_tiny", [ids[:10]])
    (d / "shards_bad_manifest").mkdir()
    (d / "shards_bad_manifest" / "manifest.json").write_text('{"version": 1, "shards": [')
    _copy_shards_with(good, d / "shards_null_sha256", lambda manifest: manifest.update(tokenizer_sha256=None))
    _copy_shards_with(good, d / "shards_vocab_string", lambda manifest: manifest.update(vocab_size="2048"))
    _copy_shards_with(good, d / "shards_no_token_count", lambda manifest: manifest["shards"][0].pop("num_tokens"))
    _copy_shards_with(good, d / "shards_complete_string", lambda manifest: manifest.update(complete="yes"))
    (d / "not_shards").mkdir()
    _copy_shards_with(good, d / "shards_beyond_vocab", lambda manifest: manifest["shards"][0].update(max_token_id=5000))
    unrecorded = shutil.copytree(good, d / "shards_beyond_vocab_unrecorded")
    _edit_json(unrecorded / "manifest.json", lambda manifest: manifest["shards"][0].pop("max_token_id"))
    with open(unrecorded / "part-0.bin", "r+b") as file:  # uint16 ids: the 11th token becomes 65,000
        file.seek(20)
        file.write((65000).to_bytes(2, "little"))
    escaping = {"name": "../shards/part-0"}
    _copy_shards_with(good, d / "shards_escaping", lambda manifest: manifest["shards"][0].update(escaping))
    (d / "short_key").write_text("abc\n")

    (d / "run" / "checkpoint" / "step-2").mkdir(parents=True)  # the job's checkpoints: only step 2
    (d / "not_a_checkpoint").mkdir()
    (d / "corrupt_checkpoint").mkdir()
    (d / "corrupt_checkpoint" / ".metadata").write_bytes(b"\x00garbage")
    add_manifest(d / "corrupt_checkpoint")  # the garbage is what was saved: only DCP can tell
    _save_other_flavor_checkpoint(d / "other_flavor" / "step-3")
    _save_seq32_progress(d / "seq32" / "step-4")
    _tamper_with(shutil.copytree(d / "other_flavor", d / "tampered") / "step-3")
    (shutil.copytree(d / "other_flavor", d / "unverified") / "step-3" / MANIFEST).unlink()
    bad_size = shutil.copytree(d / "other_flavor", d / "bad_manifest") / "step-3" / MANIFEST
    _edit_json(bad_size, lambda manifest: manifest["files"]["__0_0.distcp"].update(size="big"))
    hostile = shutil.copytree(d / "other_flavor", d / "hostile_metadata") / "step-3"
    replace_metadata(hostile, lambda metadata: setattr(metadata, "planner_data", Payload(d / "marker")))
    rewrite_manifest(hostile)
    legacy_checkpoint(shutil.copytree(d / "other_flavor", d / "hostile_entry") / "step-3", "train.rope_theta",
                      Payload(d / "marker"))  # fmt: skip
    (d / "full_output").mkdir()
    (d / "full_output" / "keep.txt").write_text("someone's files\n")
    _write_hf_folders(d)
    foreign_cases.build(d)
    return d


# The catalogue -----------------------------------------------------------------------------------------

TEXT = ["--training.dataset", "text", "--training.dataset_path", "{d}/text.txt"]
SHARDS = ["--training.dataset", "shards", "--training.dataset_path"]
MIXTURE = ["--training.dataset", "shards", "--training.dataset_mixture"]
GENERATE = ["--model.flavor", "tiny", "--prompt", "hello"]
TAMPERED = ["--model.flavor", "debugmodel", "--prompt", "hello", "--checkpoint.folder", "{d}/tampered"]
GEN, CONVERT, PREPARE = "torchpre.generate", "torchpre.convert", "torchpre.data.prepare"
HF_LLAMA = "assets/hf_configs/llama_tiny.json"
HF = ["--model.name", "hf", "--model.hf_config"]
FROM_HF = ["--model.flavor", "from_hf"]
# Architectures with a refused layout (docs/hf-models.md): every layout (its init), tensor parallel (MLA attention),
# pipeline parallel (its layers return tuples), sequence parallel (its eager attention takes a mask tensor).
HF_REFUSED = ("mamba", "deepseek_v3", "bloom", "gemma2")
TP2, PP2 = ["--parallelism.tensor_parallel_degree", "2"], ["--parallelism.pipeline_parallel_degree", "2"]


CP2 = ["--parallelism.context_parallel_degree", "2"]
MUP = ["--model.parametrization", "mup"]
DSV3 = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"]


def case(case_id: str, argv: list[str], fragments: list[str], entry: str = "train.py", ranks: int = 1):
    """One bad input: `argv` for `entry` ({d} is the files folder), launched as `ranks` processes, and the
    fragments that every rank's one-line message must contain."""
    return pytest.param(entry, argv, fragments, ranks, id=case_id)


CATALOGUE = [
    # The command line and the config file.
    case("cli-unknown-option", ["--training.stepz", "3"], ["'--training.stepz'", "command line", "training.steps"]),
    case("cli-wrong-type", ["--training.steps", "many"], ["'training.steps'", "int", "'many'"]),
    case("cli-bad-bool", ["--checkpoint.enable", "maybe"], ["'checkpoint.enable'", "'maybe'", "true/false"]),
    case("cli-missing-value", ["--training.steps"], ["'--training.steps'", "needs a value"]),
    case("cli-positional-argument", ["steps=3"], ["Unexpected argument 'steps=3'", "--section.key"]),
    case("cli-bad-dict", ["--training.dataset_mixture", "web"], ["'training.dataset_mixture'", "name=value"]),
    case(
        "toml-unknown-section",
        ["--job.config_file", "{d}/unknown_section.toml"],
        ["'trainin'", "{d}/unknown_section.toml", "'training'"],
    ),
    case(
        "toml-unknown-key",
        ["--job.config_file", "{d}/unknown_key.toml"],
        ["'training.local_batch'", "{d}/unknown_key.toml", "'training.local_batch_size'"],
    ),
    case(
        "toml-wrong-type",
        ["--job.config_file", "{d}/wrong_type.toml"],
        ["'training.steps'", "{d}/wrong_type.toml", "'ten'", "int"],
    ),
    case(
        "toml-malformed",
        ["--job.config_file", "{d}/malformed.toml"],
        ["Invalid TOML", "{d}/malformed.toml", "line 1"],
    ),
    case("config-file-missing", ["--job.config_file", "no/such.toml"], ["no/such.toml", "job.config_file"]),
    case("config-file-is-a-folder", ["--job.config_file", "{d}"], ["Cannot read config file {d}"]),
    # Values.
    case("steps-zero", ["--training.steps", "0"], ["training.steps = 0", "at least 1"]),
    case("lr-negative", ["--optimizer.lr", "-1e-3"], ["optimizer.lr = -0.001", "positive"]),
    case("local-batch-zero", ["--training.local_batch_size", "0"], ["training.local_batch_size = 0"]),
    case("global-batch-negative", ["--training.global_batch_size", "-2"], ["training.global_batch_size = -2", "-1"]),
    case("ramp-syntax", ["--training.global_batch_size", "8", "--training.batch_rampup", "4,4"],
         ['training.batch_rampup = "4,4"', '"start,increment,samples"']),
    case("ramp-start-above-global", ["--training.global_batch_size", "8", "--training.batch_rampup", "16,4,100"],
         ["training.batch_rampup starts at 16 sequences", "training.global_batch_size = 8"]),
    case("ramp-not-divisible-dp2",
         ["--training.global_batch_size", "16", "--training.batch_rampup", "4,2,100",
          "--parallelism.data_parallel_degree", "2"],
         ["training.batch_rampup", "4, 6, 10, 12, 14 are not divisible", "4 x 2 = 8", "multiples of 8"], ranks=2),
    case("stages-go-backwards", ["--job.config_file", "{d}/stages_backwards.toml"],
         ["training.data_stages: stage 3 ('stage-3') starts at step 4, not after stage 2", "overlap or go backwards"]),
    case("stages-on-the-command-line", ["--training.data_stages", "0"],
         ["'training.data_stages'", "[[training.data_stages]] tables"]),
    case("global-batch-indivisible", ["--training.global_batch_size", "6"], ["global_batch_size = 6", "multiple of 4"]),
    case("seq-len-zero", ["--training.seq_len", "0"], ["training.seq_len = 0"]),
    case("seq-len-longer-than-the-data", [*TEXT[:3], "{d}/short.txt"], ["{d}/short.txt", "training.seq_len + 1 = 33"]),
    case("lr-scheduler-decay-ratio", ["--lr_scheduler.decay_ratio", "1.5"], ["lr_scheduler.decay_ratio = 1.5"]),
    case("lr-scheduler-warmup-negative", ["--lr_scheduler.warmup_steps", "-1"], ["lr_scheduler.warmup_steps = -1"]),
    case("lr-scheduler-decay-type", ["--lr_scheduler.decay_type", "cosin"], ["lr_scheduler.decay_type", "'cosine'"]),
    case("zero-stage", ["--optimizer.zero_stage", "5"], ["optimizer.zero_stage = 5"]),
    case("muon-ns-steps", ["--optimizer.name", "Muon", "--optimizer.muon_ns_steps", "0"],
         ["optimizer.muon_ns_steps = 0", "between 1 and 99"]),
    case("muon-key-for-adamw", ["--optimizer.muon_momentum", "0.9"], ["optimizer.muon_momentum = 0.9", "AdamW"]),
    case("matrix-optimizer-on-shards",
         ["--job.custom_import", "tests.matrix_optimizer", "--optimizer.name", "TorchMuon", "--optimizer.zero_stage",
          "1"], ["optimizer.name = 'TorchMuon'", "not elementwise", "optimizer.zero_stage = 1", "Muon"]),
    case("vocab-size-negative", ["--model.vocab_size", "-1"], ["model.vocab_size = -1"]),
    case("gc-freq-negative", ["--training.gc_freq", "-1"], ["training.gc_freq = -1", "at least 0"]),
    case("init-timeout-zero", ["--comm.init_timeout_seconds", "0"], ["comm.init_timeout_seconds = 0.0", "positive"]),
    case("trace-buffer-negative", ["--comm.trace_buf_size", "-1"], ["comm.trace_buf_size = -1", "at least 0"]),
    case(
        "vocab-size-below-the-tokenizers",
        ["--model.vocab_size", "1000"],
        ["model.vocab_size = 1000", "tokenizer's 2048 ids", "training.dataset = 'stdlib'", "'synthetic'"],
    ),
    case(
        "synthetic-with-a-path",
        ["--training.dataset", "synthetic", "--training.dataset_path", "{d}/text.txt"],
        ["training.dataset_path", "'synthetic'"],
    ),
    case(
        "synthetic-held-out-validation",
        ["--training.dataset", "synthetic", "--validation.enable"],
        ["validation.enable with training.dataset = 'synthetic'", "validation.dataset"],
    ),
    case(
        "eval-task-malformed-line",
        ["--eval.tasks", "{d}/bad_json_task.jsonl"],
        ["eval.tasks: {d}/bad_json_task.jsonl (line 2) is not valid JSON"],
        ranks=2,
    ),
    case(
        "eval-task-answer-out-of-range",
        ["--eval.tasks", "{d}/bad_answer_task.jsonl"],
        ["eval.tasks: {d}/bad_answer_task.jsonl:2:", "'answer' = 2 is not an index into its 2 choices"],
    ),
    case(
        "eval-task-not-utf8",
        ["--eval.tasks", "{d}/not_utf8_task.jsonl"],
        ["eval.tasks: {d}/not_utf8_task.jsonl (line 2) is not UTF-8 text (byte 16)"],
        ranks=2,
    ),
    case(
        "eval-window-longer-than-the-model",
        ["--eval.tasks", "{d}/task.jsonl", "--eval.max_length", "4096"],
        ["eval.max_length = 4096 is longer than the model's context of 2048 tokens"],
    ),
    case(
        "eval-window-sequence-parallel",
        ["--eval.tasks", "{d}/task.jsonl", "--eval.max_length", "33", *TP2, "--parallelism.enable_sequence_parallel"],
        ["eval.max_length = 33", "not divisible by parallelism.tensor_parallel_degree = 2"],
        ranks=2,
    ),
    case("eval-task-missing", ["--eval.tasks", "{d}/missing.jsonl"], ["eval.tasks: {d}/missing.jsonl does not exist"]),
    case("eval-task-not-jsonl", ["--eval.tasks", "{d}/text.txt"], ["eval.tasks names '{d}/text.txt'", ".jsonl"]),
    case(
        "eval-under-context-parallel",
        ["--eval.tasks", "{d}/bad_answer_task.jsonl", *CP2],
        ["eval.tasks", "context_parallel_degree > 1"],
        ranks=2,
    ),
    case("hf-export-interval-zero", ["--hf_export.interval", "0"], ["hf_export.interval = 0", "at least 1"]),
    case(
        "hf-export-without-adapter",
        ["--model.name", "moe", "--hf_export.enable"],
        ["hf_export.enable", "model.name = 'moe' has no Hugging Face conversion"],
    ),
    case(
        "hf-export-folder-not-writable",  # /sys takes no new file even from root, whom a folder's mode does not stop
        ["--hf_export.enable", "--hf_export.folder", "/sys/torchpre-hf"],
        ["hf_export.folder '/sys/torchpre-hf'", "cannot write there (it would be created in /sys)"],
        ranks=2,
    ),
    case(
        "load-step-without-checkpoints",
        ["--checkpoint.load_step", "5"],
        ["checkpoint.load_step = 5 with checkpoint.enable off", "train from step 0", "checkpoint.enable = true"],
        ranks=2,
    ),
    case(
        "hf-export-into-checkpoint-folder",
        ["--hf_export.enable", "--checkpoint.enable", "--hf_export.folder", "checkpoint"],
        ["hf_export.folder = checkpoint.folder = 'checkpoint'"],
    ),
    case(
        "hsdp-without-zero-3",
        ["--parallelism.data_parallel_replicate_degree", "2"],
        ["parallelism.data_parallel_replicate_degree = 2", "optimizer.zero_stage = 3"],
    ),
    case("exclude-from-loading", ["--checkpoint.exclude_from_loading", "optimiser"], ["'optimiser'", "optimizer"]),
    case("unknown-model-name", ["--model.name", "llama4"], ["model.name", "'llama4'", "'llama3'"]),
    case(
        "module-entry-custom-import-missing",
        ["--job.custom_import", "my_package.my_model"],
        ["job.custom_import = 'my_package.my_model'", "no module named 'my_package'"],
        entry="torchpre.train",
    ),
    case(
        "selective-op-ac-zero-bubble",
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "ZBVZeroBubble",
            "--activation_checkpoint.mode",
            "selective",
        ],
        ["activation_checkpoint.selective_ac_option = 'op'", "'ZBVZeroBubble'", "mode = 'full'", "1F1B"],
        ranks=2,
    ),  # fmt: skip
    case("hf-config-missing", ["--model.name", "hf"], ["model.name = 'hf' needs model.hf_config", "config.json"]),
    case("hf-config-not-a-file", [*HF, "no/such.json"], ["model.hf_config = no/such.json", "does not exist"]),
    case(
        "hf-config-not-json",
        [*HF, "{d}/hf_not_json.json"],
        ["model.hf_config = {d}/hf_not_json.json", "not valid JSON", "line 2"],
    ),
    case(
        "hf-encoder-model-type",
        [*HF, "{d}/hf_bert.json"],
        ["model.hf_config = {d}/hf_bert.json", "model_type = 'bert' is not a model torchpre trains", "encoder family"],
    ),
    case(
        "hf-dropout",
        [*HF, "{d}/hf_gpt2.json"],
        ["model.hf_config = {d}/hf_gpt2.json", "resid_pdrop = 0.1", "each parallel layout", "Set them to 0.0"],
    ),
    case(
        "hf-refused-under-every-layout",
        [*HF, "{d}/hf_mamba.json"],
        ["model.hf_config = {d}/hf_mamba.json", "MambaForCausalLM (model_type 'mamba') is refused under every layout",
         "A_log"],
    ),  # fmt: skip
    case(
        "hf-tensor-parallel-refused",
        [*HF, "{d}/hf_deepseek_v3.json", *TP2],
        ["DeepseekV3ForCausalLM (model_type 'deepseek_v3') under tensor parallel: refused",
         "model.layers.0.self_attn.q_a_proj (Linear) has no tensor-parallel rule", "It trains under data parallel"],
        ranks=2,
    ),  # fmt: skip
    case(
        "hf-pipeline-parallel-refused",
        [*HF, "{d}/hf_bloom.json", *PP2],
        ["BloomForCausalLM (model_type 'bloom') under pipeline parallel: refused",
         "its decoder layers do not run as pipeline stages", "It trains under data parallel, ZeRO-3 (FSDP), tensor"],
        ranks=2,
    ),  # fmt: skip
    case(
        "hf-sequence-parallel-refused",
        [*HF, "{d}/hf_gemma2.json", *TP2, "--parallelism.enable_sequence_parallel"],
        ["Gemma2ForCausalLM (model_type 'gemma2') under sequence and loss parallel: refused",
         "hands the layers an attention-mask tensor"],
        ranks=2,
    ),
    case(
        "hf-encoder-decoder-family",
        [*HF, "{d}/hf_bart.json"],
        ["model_type = 'bart' is not a model torchpre trains", "encoder-decoder family", "the decoder half"],
    ),
    case(
        "hf-encoder-decoder-without-causal-lm",
        [*HF, "{d}/hf_t5.json"],
        ["model_type = 't5' is not a model torchpre trains", "encoder-decoder family", "it has no causal LM"],
    ),
    case(
        "hf-unknown-model-type",
        [*HF, "{d}/hf_unknown.json"],
        ["model_type = 'llama9'", "does not know this model_type", "misspelt"],
    ),
    case(
        "hf-decoder-said-encoder-decoder",
        [*HF, "{d}/hf_llama_encoder_decoder.json"],
        ["{d}/hf_llama_encoder_decoder.json: is_encoder_decoder = true", "'llama' is a decoder-only causal LM"],
    ),
    case(
        "hf-embedding-multiplier-under-pp",
        [*HF, "{d}/hf_granite_multiplier.json", *PP2],
        ["GraniteForCausalLM (model_type 'granite') under pipeline parallel: refused",
         "two pipeline stages of it do not reproduce its forward"],
        ranks=2,
    ),  # fmt: skip
    case(
        "hf-window-shorter-than-seq-len-under-sp",
        [*HF, "{d}/hf_gemma3_window.json", *TP2, "--parallelism.enable_sequence_parallel",
         "--parallelism.enable_loss_parallel"],
        ["Gemma3ForCausalLM (model_type 'gemma3_text') under sequence and loss parallel: refused",
         "sliding window (16) is shorter than training.seq_len = 32"],
        ranks=2,
    ),  # fmt: skip
    case("hf-vocab-too-small", [*HF, "{d}/hf_small_vocab.json"], ["vocab_size = 1000", "tokenizer's 2048 ids"]),
    case(
        "hf-config-of-another-model-than-the-folders",
        [*HF, "{d}/hf_llama_other_math.json", "--checkpoint.initial_load_path", "{d}/hf_llama"],
        ["{d}/hf_llama: its config.json does not describe the job's model",
         "rms_norm_eps = 1e-05, but model.hf_config has 0.01",
         "rope_parameters.rope_theta = 500000.0, but model.hf_config has 10000.0",
         "give the folder as model.hf_config"],
    ),  # fmt: skip
    # checkpoint.initial_load_path = a Hugging Face folder, model.flavor = 'from_hf'.
    case("from-hf-without-a-folder", FROM_HF, ["model.flavor = 'from_hf'", "checkpoint.initial_load_path", "unset"]),
    case(
        "from-hf-not-a-hugging-face-folder",
        [*FROM_HF, "--checkpoint.initial_load_path", "{d}/not_a_checkpoint"],
        ["model.flavor = 'from_hf'", "'{d}/not_a_checkpoint', which is not one"],
    ),
    case(
        "from-hf-family-without-a-config-mapping",
        ["--model.name", "moe", *FROM_HF, "--checkpoint.initial_load_path", "{d}/hf_llama"],
        ["model.flavor = 'from_hf' with model.name = 'moe'", "cannot read its args from a Hugging Face config.json"],
    ),
    case(
        "hf-folder-unknown-config-field",
        [*FROM_HF, "--checkpoint.initial_load_path", "{d}/hf_unknown_field"],
        ["{d}/hf_unknown_field/config.json", "sliding_window = 16 is a field torchpre's llama3 does not know"],
        ranks=2,
    ),
    case(
        "hf-folder-of-another-model",
        ["--checkpoint.initial_load_path", "{d}/hf_llama"],
        ["checkpoint.initial_load_path = {d}/hf_llama", "does not describe the job's model", "num_hidden_layers = 3",
         "model.flavor = 'from_hf' reads it from the folder"],
        ranks=2,
    ),  # fmt: skip
    case(
        "hf-folder-missing-tensor",
        [*FROM_HF, "--checkpoint.initial_load_path", "{d}/hf_missing_tensor"],
        ["checkpoint.initial_load_path = {d}/hf_missing_tensor", "1 missing: model.layers.1.mlp.up_proj.weight"],
    ),
    case(
        "hf-folder-vocab-below-the-tokenizer",
        [*FROM_HF, "--checkpoint.initial_load_path", "{d}/hf_small_vocab_folder"],
        ["tokenizer.model (model.tokenizer_path) has 2048 ids, more than the 1000 rows"],
    ),
    case(
        "hf-folder-family-without-mapping",
        ["--model.name", "moe", "--checkpoint.initial_load_path", "{d}/hf_llama"],
        ["checkpoint.initial_load_path = {d}/hf_llama is a Hugging Face folder", "no mapping from one"],
    ),
    case(
        "hf-folder-damaged-file",
        [*FROM_HF, "--checkpoint.initial_load_path", "{d}/hf_damaged"],
        ["{d}/hf_damaged/model-00001-of-00001.safetensors is not a readable safetensors file"],
    ),
    case(
        "hf-folder-index-names-a-file-outside",
        [*FROM_HF, "--checkpoint.initial_load_path", "{d}/hf_escaping_index"],
        ["{d}/hf_escaping_index/model.safetensors.index.json", "weight_map['model.norm.weight']", "climbs out"],
    ),
    case(
        "hf-tp-does-not-divide-kv-heads",
        [*HF, HF_LLAMA, "--parallelism.tensor_parallel_degree", "4"],
        ["LlamaForCausalLM (model_type 'llama') under tensor parallel: refused", "num_key_value_heads = 2",
         "parallelism.tensor_parallel_degree = 4", "1, 2)"],
        ranks=4,
    ),
    # The shape on top of a flavor (model.dim, n_layers, n_heads, n_kv_heads) and model.parametrization.
    case("shape-key-negative", ["--model.dim", "-64"], ["model.dim = -64", "must be positive"]),
    case("shape-does-not-hold", ["--model.dim", "66"],
         ["model.dim = 66 on model.name = 'llama3', model.flavor = 'tiny'", "not divisible by n_heads 4"]),
    case("shape-key-the-family-does-not-take", [*DSV3, "--model.n_kv_heads", "2"],
         ["model.n_kv_heads = 2 with model.name = 'deepseek_v3'", "it takes model.dim, model.n_layers, model.n_heads"]),
    case("shape-width-field-not-whole", [*DSV3, "--model.flavor", "2B", "--model.dim", "1000"],
         ["model.dim = 1000", "moe_hidden_dim (512 at dim 1536) follows the width", "a multiple of 3"]),
    case("shape-keys-with-hf", [*HF, HF_LLAMA, "--model.dim", "128"],
         ["model.dim = 128", "model.name = 'hf' takes its shape from model.hf_config"]),
    case("shape-keys-with-from-hf", [*FROM_HF, "--checkpoint.initial_load_path", "{d}/hf_llama", "--model.dim", "128"],
         ["model.dim = 128", "model.flavor = 'from_hf' takes the shape of the folder's config.json"]),
    case("mup-keys-under-sp", ["--model.mup_base_dim", "64"],
         ["model.mup_base_dim = 64 with model.parametrization = 'sp'", "'mup' or 'complete_p'"]),
    case("mup-base-depth-under-mup", [*MUP, "--model.mup_base_depth", "2"],
         ["model.mup_base_depth = 2 with model.parametrization = 'mup'", "'complete_p' only"]),
    case("mup-family-without-multipliers", [*HF, HF_LLAMA, *MUP],
         ["model.parametrization = 'mup' with model.name = 'hf'", "no multipliers to set", "moe or deepseek_v3"]),
    case("mup-with-muon", [*MUP, "--optimizer.name", "Muon"],
         ["model.parametrization = 'mup' with optimizer.name = 'Muon'", "spectral scaling", "Use AdamW"]),
    case("mup-from-a-hugging-face-folder", [*MUP, "--checkpoint.initial_load_path", "{d}/hf_llama"],
         ["checkpoint.initial_load_path = {d}/hf_llama is a Hugging Face folder, with model.parametrization = 'mup'",
          "without the µP multipliers"]),
    case("mup-base-does-not-hold", [*MUP, "--model.mup_base_dim", "66"],
         ["The base model (model.mup_base_dim = 66, depth 2) does not hold", "not divisible by n_heads 4"]),
    case("mup-base-depth-without-every-block", [*DSV3, "--model.parametrization", "complete_p",
                                                "--model.mup_base_depth", "1"],
         ["model.mup_base_depth = 1", "no 'layers.*.moe.router.weight'"]),
    case("mup-multiplier-not-positive", [*MUP, "--model.mup_logit_multiplier", "0"],
         ["model.mup_logit_multiplier = 0.0", "must be positive"]),
    case("mup-base-negative", [*MUP, "--model.mup_base_dim", "-1"], ["model.mup_base_dim = -1", "must be positive"]),
    case("unknown-flavor", ["--model.flavor", "debugmodell"], ["model.flavor", "'debugmodell'", "'debugmodel'"]),
    case(
        "unknown-schedule",
        ["--parallelism.pipeline_parallel_schedule", "1f1b"],
        ["'parallelism.pipeline_parallel_schedule'", "did you mean '1F1B'"],
    ),
    case("dump-folder-is-a-file", ["--job.dump_folder", "{d}/a_file"], ["job.dump_folder", "{d}/a_file", "is a file"]),
    case(
        "checkpoint-folder-under-a-file",
        ["--checkpoint.enable", "--checkpoint.folder", "{d}/a_file/checkpoints"],
        ["checkpoint.folder", "lies under the file {d}/a_file"],
    ),
    # Layouts, on every rank.
    case("layout-larger-than-the-world", ["--parallelism.data_parallel_degree", "2"], ["2 x 1 x 1 = 2", "1 launched"]),
    case(
        "tp-does-not-divide-heads",
        ["--parallelism.tensor_parallel_degree", "3"],
        ["n_heads = 4", "tensor_parallel_degree = 3"],
        ranks=3,
    ),
    case(
        "sequence-parallel-seq-len",
        ["--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_sequence_parallel"]
        + ["--training.seq_len", "33"],
        ["training.seq_len = 33", "enable_sequence_parallel"],
        ranks=2,
    ),
    case(
        "pp-microbatch-size-does-not-divide",
        ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "3"],
        ["pipeline_parallel_microbatch_size = 3", "4 sequences"],
        ranks=2,
    ),
    case(
        "pp-too-few-microbatches",
        ["--training.local_batch_size", "2", "--parallelism.pipeline_parallel_degree", "2"]
        + ["--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"],
        ["'ZBVZeroBubble' schedule needs at least as many microbatches as stages (4)"],
        ranks=2,
    ),
    case(
        "pp-too-few-layers",
        ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_virtual_stages", "2"]
        + ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"],
        ["2 layers, fewer than the 4 pipeline stages"],
        ranks=2,
    ),
    case(
        "pp-embedding-layers-with-split-points",
        ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_split_points", "layers.1"]
        + ["--parallelism.pipeline_parallel_embedding_layers", "1"],
        ["pipeline_parallel_split_points names each stage's first layer",
         "parallelism.pipeline_parallel_embedding_layers = 1"],
        ranks=2,
    ),
    case(
        "pp-embedding-and-output-layers-leave-a-middle-stage-empty",
        ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_virtual_stages", "3"]
        + ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]
        + ["--parallelism.pipeline_parallel_embedding_layers", "1"]
        + ["--parallelism.pipeline_parallel_output_layers", "1"],
        ["2 layers", "give [0, 1, 1, 1, 0, -1] blocks",
         "only the first stage (the embedding) and the last (the output)"],
        ranks=2,
    ),
    case("global-batch-dp2", ["--training.global_batch_size", "12"], ["global_batch_size = 12", "4 x 2 = 8"], ranks=2),
    case(
        "cp-seq-len-not-divisible",
        [*CP2, "--training.seq_len", "30"],
        ["context_parallel_degree = 2", "training.seq_len = 30", "2 x 2 = 4", "multiple of 4"],
        ranks=2,
    ),
    case(
        "cp-does-not-divide-the-world",
        CP2,
        ["world size 3", "context_parallel_degree = 1 x 1 x 2", "multiple of 2", "(multiples of 2 = the context"],
        ranks=3,
    ),
    case(
        "cp-sequence-parallel-seq-len",
        [*CP2, "--model.flavor", "debugmodel", "--parallelism.tensor_parallel_degree", "4"]
        + ["--parallelism.enable_sequence_parallel", "--training.seq_len", "36"],
        ["context_parallel_degree = 2", "18 positions", "tensor_parallel_degree = 4", "multiple of 8"],
        ranks=8,
    ),
    case(
        "global-batch-in-tokens-no-whole-sequences",
        ["--checkpoint.enable", "--checkpoint.folder", "{d}/seq32", "--training.seq_len", "96"]
        + ["--training.global_batch_unit", "tokens"],
        ["{d}/seq32/step-4", "4 sequences x 32 tokens = 128 tokens per step", "training.global_batch_unit = 'tokens'",
         "training.seq_len = 96", "global_batch_unit = 'sequences'"],
    ),  # fmt: skip
    case(
        "global-batch-in-tokens-not-a-multiple-of-the-layout",
        ["--checkpoint.enable", "--checkpoint.folder", "{d}/seq32", "--training.seq_len", "64"]
        + ["--training.global_batch_unit", "tokens"],
        ["training.global_batch_unit = 'tokens' keeps at training.seq_len = 64 as 2 sequences",
         "training.local_batch_size x data-parallel degree = 4 x 1 = 4"],
    ),  # fmt: skip
    case(
        "global-batch-in-tokens-and-another-size",
        ["--checkpoint.enable", "--checkpoint.folder", "{d}/seq32", "--training.seq_len", "64"]
        + ["--training.global_batch_unit", "tokens", "--training.global_batch_size", "4"],
        ["keeps at training.seq_len = 64 as 2 sequences", "training.global_batch_size = 4 asks for 4",
         "global_batch_size = -1 (or 2)"],
    ),  # fmt: skip
    case(
        "rope-key-for-a-family-that-ignores-it",
        [*HF, HF_LLAMA, "--model.rope_theta", "1000000"],
        ["model.rope_theta = 1000000.0 with model.name = 'hf'", "does not read it", "model.hf_config"],
    ),
    case(
        "cp-model-family-without-cp-attention",
        [*HF, HF_LLAMA, *CP2],
        ["context_parallel_degree = 2", "model.name = 'hf' has no context-parallel attention", "llama3, moe"],
        ranks=2,
    ),
    case(
        "loss-chunk-size-negative",
        ["--training.loss_chunk_size", "-1"],
        ["training.loss_chunk_size = -1", "at least 0"],
    ),
    case(
        "loss-chunks-for-a-family-without-an-output-layer",
        [*HF, HF_LLAMA, "--training.loss_chunk_size", "64"],
        ["training.loss_chunk_size = 64: model.name = 'hf' names no output layer", "training.loss_chunk_size = 0",
         "llama3, moe, deepseek_v3"],
        ranks=2,
    ),  # fmt: skip
    case(
        "loss-chunks-with-a-quantized-output-layer",
        ["--training.loss_chunk_size", "64", "--quantize.linear", "float8", "--quantize.modules", "layers.*,output"],
        ["training.loss_chunk_size = 64 with quantize.linear = 'float8'", "names the output layer 'output'",
         "Leave it out of quantize.modules"],
    ),  # fmt: skip
    # Low precision (quantize.*; torchao missing: tests/unit/test_quantize.py, since this process has torchao).
    case(
        "mtp-for-a-family-without-it",
        ["--model.mtp_depth", "1"],
        ["model.mtp_depth = 1 with model.name = 'llama3'", "model.name = 'deepseek_v3'", "model.mtp_depth = 0"],
    ),
    case(
        "mtp-negative-weight",
        ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--model.mtp_depth", "1",
         "--model.mtp_loss_weight", "-0.1"],
        ["model.mtp_loss_weight -0.1", ">= 0"],
    ),
    case(
        "mtp-deeper-than-the-sequence",
        ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--model.mtp_depth", "8",
         "--training.seq_len", "8"],
        ["model.mtp_depth = 8", "sequences of 8 tokens", "model.mtp_depth < 8"],
    ),  # fmt: skip
    case(
        "quantize-recipe-without-a-format",
        ["--quantize.recipe", "tensorwise"],
        ["quantize.recipe = 'tensorwise' with quantize.linear = 'none'", "full precision", "'float8' or 'mxfp8'"],
        ranks=2,
    ),
    case(
        "quantize-pattern-matches-no-linear",
        ["--quantize.linear", "mxfp8", "--quantize.modules", "layers.*.feed_forwrd.*"],
        ["quantize.modules: the pattern 'layers.*.feed_forwrd.*' matches no linear", "layers.0.attention.wq"],
        ranks=2,
    ),
    case(
        "muon-pattern-matches-no-parameter",
        ["--optimizer.name", "Muon", "--optimizer.muon_adamw_params", "layers.*.atention.*"],
        ["optimizer.muon_adamw_params: the pattern 'layers.*.atention.*' matches no parameter", "tok_embeddings"],
    ),
    case(
        "cli-value-not-a-choice",
        ["--quantize.linear", "FP8"],
        ["Invalid value 'FP8' for 'quantize.linear'", "'none', 'float8', 'mxfp8'"],
        ranks=2,
    ),
    case(
        "fp8-kernels-asked-on-cpu",
        ["--quantize.linear", "float8", "--quantize.emulate", "false"],
        ["quantize.emulate = 'false'", "compute capability 8.9", "a cpu device", "quantize.emulate = 'auto'"],
    ),
    case(
        "mxfp8-kernels-asked-on-cpu",
        ["--quantize.linear", "mxfp8", "--quantize.emulate", "false"],
        ["quantize.emulate = 'false'", "compute capability 10.0", "a cpu device"],
    ),
    case(
        "mxfp8-tensorwise-recipe",
        ["--quantize.linear", "mxfp8", "--quantize.recipe", "tensorwise"],
        ["quantize.recipe = 'tensorwise' with quantize.linear = 'mxfp8'", "quantize.recipe = 'rowwise'"],
        ranks=2,
    ),
    case(
        "mxfp8-positions-per-rank-under-cp",
        ["--quantize.linear", "mxfp8", *CP2],
        ["quantize.linear = 'mxfp8'", "training.seq_len / parallelism.context_parallel_degree 2 = 16",
         "multiple of 32", "rowwise_with_gw_hp"],
        ranks=2,
    ),  # fmt: skip
    case(
        "fp8-all-gather-rowwise",
        ["--quantize.linear", "float8", "--quantize.fsdp_float8_all_gather", "--optimizer.zero_stage", "3"],
        ["quantize.fsdp_float8_all_gather with quantize.linear = 'float8' and quantize.recipe = 'rowwise'",
         "quantize.recipe = 'tensorwise'"],
        ranks=2,
    ),  # fmt: skip
    case(
        "fp8-all-gather-without-zero3",
        ["--quantize.linear", "float8", "--quantize.recipe", "tensorwise", "--quantize.fsdp_float8_all_gather"],
        ["quantize.fsdp_float8_all_gather with optimizer.zero_stage = 0", "optimizer.zero_stage = 3"],
        ranks=2,
    ),
    case(
        "fp8-all-gather-with-tp",
        ["--quantize.linear", "float8", "--quantize.recipe", "tensorwise", "--quantize.fsdp_float8_all_gather",
         "--optimizer.zero_stage", "3", *TP2],
        ["quantize.fsdp_float8_all_gather with parallelism.tensor_parallel_degree = 2", "its own scale"],
        ranks=4,
    ),  # fmt: skip
    case(
        "experts-quantized-in-a-family-without-experts",
        ["--quantize.linear", "mxfp8", "--quantize.experts"],
        ["quantize.experts with model.name = 'llama3'", "no routed experts", "model.name = 'moe' or 'deepseek_v3'"],
    ),
    case(
        "experts-quantized-without-a-format",
        ["--model.name", "moe", "--quantize.experts"],
        ["quantize.experts with quantize.linear = 'none'", "quantize.linear = 'mxfp8'"],
    ),
    case(
        "float8-experts",
        ["--model.name", "moe", "--quantize.linear", "float8", "--quantize.experts"],
        ["quantize.experts with quantize.linear = 'float8'", "no emulation", "quantize.linear = 'mxfp8'"],
        ranks=2,
    ),
    case(
        "mxfp8-experts-sliced-below-32-by-tp",
        ["--model.name", "moe", "--model.flavor", "tiny", "--quantize.linear", "mxfp8", "--quantize.experts", *TP2],
        ["moe_hidden_dim / parallelism.tensor_parallel_degree = 16", "multiples of 32"],
        ranks=2,
    ),
    # Data.
    case("tokenizer-missing", ["--model.tokenizer_path", "no/such.model"], ["no/such.model", "model.tokenizer_path"]),
    case("tokenizer-corrupt", ["--model.tokenizer_path", "{d}/corrupt.model"], ["{d}/corrupt.model:1", "tiktoken"]),
    case("tokenizer-lacks-bytes", ["--model.tokenizer_path", "{d}/no_bytes.model"], ["{d}/no_bytes.model", "byte"]),
    case("tokenizer-folder-without-one", ["--model.tokenizer_path", "{d}"], ["Tokenizer {d} holds no tokenizer.json"]),
    case("text-missing", [*TEXT[:3], "no/such.jsonl"], ["no/such.jsonl", "does not exist"]),
    case("text-empty", [*TEXT[:3], "{d}/empty.txt"], ["{d}/empty.txt", "no text"]),
    case("jsonl-non-string", [*TEXT[:3], "{d}/non_string.jsonl"], ["{d}/non_string.jsonl:2", "'text' is int"]),
    case("jsonl-not-utf8", [*TEXT[:3], "{d}/not_utf8.jsonl"], ["{d}/not_utf8.jsonl (line 1) is not UTF-8 text"]),
    case("shards-missing", [*SHARDS, "no/such"], ["training.dataset_path", "'no/such'", "torchpre.data.prepare"]),
    case("shards-not-a-shard-folder", [*SHARDS, "{d}/not_shards"], ["{d}/not_shards", "manifest.json"]),
    case("shards-truncated", [*SHARDS, "{d}/shards_truncated"], ["{d}/shards_truncated/part-0.bin", "truncated"]),
    case(
        "shards-other-tokenizer",
        [*SHARDS, "{d}/shards_other_tokenizer"],
        ["{d}/shards_other_tokenizer", "model.tokenizer_path", "tokenizer"],
    ),
    case("shards-incomplete", [*SHARDS, "{d}/shards_incomplete"], ["{d}/shards_incomplete", "incomplete"]),
    case("shards-bad-manifest", [*SHARDS, "{d}/shards_bad_manifest"], ["{d}/shards_bad_manifest/manifest.json"]),
    case(
        "shards-token-id-beyond-the-vocabulary",
        [*SHARDS, "{d}/shards_beyond_vocab"],
        ["{d}/shards_beyond_vocab/part-0.bin: its manifest records token id 5,000",
         "the model's embedding has 2,048 rows", "prepare"],
    ),
    case(
        "shards-token-id-beyond-the-vocabulary-unrecorded",
        [*SHARDS, "{d}/shards_beyond_vocab_unrecorded"],
        ["{d}/shards_beyond_vocab_unrecorded/part-0.bin: at token offset 10 holds token id 65,000",
         "the model's embedding has 2,048 rows"],
    ),
    case(
        "shards-name-outside-the-folder",
        [*SHARDS, "{d}/shards_escaping"],
        ["{d}/shards_escaping/manifest.json: shards[0].name names '../shards/part-0'", "climbs out of the folder"],
    ),
    case(
        "shards-null-tokenizer-sha256",
        [*SHARDS, "{d}/shards_null_sha256"],
        ["{d}/shards_null_sha256/manifest.json", "'tokenizer_sha256' is null, not a string", "prepare"],
    ),
    case(
        "shards-vocab-size-a-string",
        [*SHARDS, "{d}/shards_vocab_string"],
        ["{d}/shards_vocab_string/manifest.json", "'vocab_size' is \"2048\", not an integer"],
    ),
    case(
        "shards-token-count-missing",
        [*SHARDS, "{d}/shards_no_token_count"],
        ["{d}/shards_no_token_count/manifest.json", "'shards[0].num_tokens' is missing"],
    ),
    case(
        "shards-complete-a-string",
        [*SHARDS, "{d}/shards_complete_string"],
        ["{d}/shards_complete_string/manifest.json", "'complete' is \"yes\", not true or false"],
    ),
    case(
        "mixture-negative-weight",
        [*MIXTURE, "{d}/shards=1,{d}/shards_tiny=-1"],
        ["training.dataset_mixture", "'{d}/shards_tiny'", "-1.0", "positive"],
    ),
    case(
        "mixture-source-too-small",
        [*MIXTURE, "{d}/shards=1,{d}/shards_tiny=1"],
        ["training.dataset_mixture", "{d}/shards_tiny", "fewer than one sample"],
    ),
    case(
        "mixture-without-shards",
        ["--training.dataset_mixture", "{d}/shards=1"],
        ["training.dataset_mixture is set", "training.dataset = 'stdlib'"],
    ),
    # Checkpoints.
    case(
        "initial-load-path-missing",
        ["--checkpoint.initial_load_path", "no/such/step-5"],
        ["checkpoint.initial_load_path", "no/such/step-5"],
    ),
    case(
        "initial-load-path-not-a-checkpoint",
        [*TEXT, "--checkpoint.initial_load_path", "{d}/not_a_checkpoint"],
        ["{d}/not_a_checkpoint", "checkpoint.initial_load_path"],
    ),
    case(
        "checkpoint-corrupt-metadata",
        [*TEXT, "--checkpoint.initial_load_path", "{d}/corrupt_checkpoint"],
        ["Cannot read the checkpoint at {d}/corrupt_checkpoint"],
    ),
    case(
        "checkpoint-other-flavor",
        [*TEXT, "--checkpoint.initial_load_path", "{d}/other_flavor/step-3"],
        ["{d}/other_flavor/step-3 does not fit this model", "model.flavor"],
    ),
    case(
        "checkpoint-without-manifest",
        [*TEXT, "--checkpoint.initial_load_path", "{d}/unverified/step-3"],
        ["checkpoint.initial_load_path", "{d}/unverified/step-3 has no manifest.json", "allow_unverified = true"],
    ),
    case(
        "resume-without-manifest",
        ["--checkpoint.enable", "--checkpoint.folder", "{d}/unverified"],
        ["checkpoint.load_step = -1 (the latest checkpoint)", "{d}/unverified/step-3 has no manifest.json",
         "checkpoint.allow_unverified = true"],
        ranks=2,
    ),  # fmt: skip
    case(
        "checkpoint-manifest-size-a-string",
        [*TEXT, "--checkpoint.initial_load_path", "{d}/bad_manifest/step-3"],
        ["{d}/bad_manifest/step-3/manifest.json is not a valid manifest", "'files.__0_0.distcp.size' is \"big\""],
    ),
    case(
        "checkpoint-load-step-negative",
        [*TEXT, "--checkpoint.enable", "--checkpoint.folder", "{d}/run/checkpoint", "--checkpoint.load_step", "-5"],
        ["checkpoint.load_step = -5 names no step", "-1 for the latest"],
    ),
    case(
        "checkpoint-signing-key-too-short",
        [*TEXT, "--checkpoint.enable", "--checkpoint.signing_key_file", "{d}/short_key"],
        ["checkpoint.signing_key_file = '{d}/short_key' holds 3 bytes", "at least 16"],
    ),
    case(
        "checkpoint-signing-key-missing",
        [*TEXT, "--checkpoint.enable", "--checkpoint.signing_key_file", "{d}/no_key"],
        ["checkpoint.signing_key_file = '{d}/no_key' cannot be read"],
    ),
    case(
        "checkpoint-metadata-holds-code",
        [*TEXT, "--checkpoint.initial_load_path", "{d}/hostile_metadata/step-3"],
        ["{d}/hostile_metadata/step-3/.metadata: refused", "it names builtins.exec", "docs/security.md"],
    ),
    case(
        "generate-checkpoint-entry-holds-code",
        [*GENERATE[2:], "--model.flavor", "debugmodel", "--checkpoint.folder", "{d}/hostile_entry"],
        ["refused to unpickle the checkpoint entry 'train.rope_theta'", "checkpoint.allow_pickle = true"],
        GEN,
    ),
    case(
        "checkpoint-load-step-missing",
        [*TEXT, "--checkpoint.enable", "--checkpoint.folder", "{d}/run/checkpoint", "--checkpoint.load_step", "5"],
        ["checkpoint.load_step = 5", "complete steps: 2"],
    ),
    # Generation.
    case("generate-no-prompt", ["--model.flavor", "tiny"], ["--prompt is required"], GEN),
    case("generate-bad-float", [*GENERATE, "--temperature", "hot"], ["'temperature'", "'hot'", "float"], GEN),
    case(
        "generate-context-parallel-larger-than-the-world",
        [*GENERATE, "--parallelism.context_parallel_degree", "3"],
        ["world size 2 is not divisible", "context_parallel_degree = 1 x 1 x 3"],
        GEN,
        ranks=2,
    ),
    case(
        "generate-longer-than-the-context",
        [*GENERATE, "--max_new_tokens", "5000"],
        ["--max_new_tokens 5000", "context of 2048"],
        GEN,
    ),
    case(
        "generate-checkpoint-missing",
        [*GENERATE, "--checkpoint.folder", "{d}/no_such"],
        ["{d}/no_such does not exist", "--checkpoint.folder"],
        GEN,
    ),
    case(
        "generate-checkpoint-other-flavor",
        [*GENERATE, "--checkpoint.folder", "{d}/other_flavor"],
        ["does not fit this model", "model.flavor"],
        GEN,
    ),
    case(
        "generate-checkpoint-without-manifest",
        [*GENERATE[2:], "--model.flavor", "debugmodel", "--checkpoint.folder", "{d}/unverified"],
        ["{d}/unverified/step-3 has no manifest.json", "checkpoint.allow_unverified = true"],
        GEN,
    ),
    case(
        "generate-every-checkpoint-tampered",
        TAMPERED,
        ["Every checkpoint in {d}/tampered is corrupt", "{d}/tampered/step-3/__0_0.distcp fails its CRC-32 check"],
        GEN,
    ),
    case(
        "generate-chosen-checkpoint-tampered",
        [*TAMPERED, "--checkpoint.load_step", "3"],
        ["checkpoint.load_step = 3: the checkpoint {d}/tampered/step-3 is corrupt", "fails its CRC-32 check"],
        GEN,
    ),
    # Conversion.
    case("convert-usage", ["to-hf", "a", "b"], ["usage: python -m torchpre.convert"], CONVERT),
    case(
        "convert-bad-dtype",
        ["dcp-to-hf", "{d}/other_flavor/step-3", "{d}/out", "--dtype", "float16"],
        ["--dtype 'float16'", "bfloat16"],
        CONVERT,
    ),
    case(
        "convert-checkpoint-missing",
        ["dcp-to-hf", "{d}/no_such/step-1", "{d}/out", "--model.flavor", "tiny"],
        ["Checkpoint folder {d}/no_such/step-1 does not exist"],
        CONVERT,
    ),
    case(
        "convert-checkpoint-corrupt",
        ["dcp-to-hf", "{d}/corrupt_checkpoint", "{d}/out", "--model.flavor", "tiny"],
        ["{d}/corrupt_checkpoint"],
        CONVERT,
    ),
    case(
        "convert-checkpoint-tampered",
        ["dcp-to-hf", "{d}/tampered/step-3", "{d}/out", "--model.flavor", "debugmodel"],
        ["dcp-to-hf CKPT_STEP_DIR", "{d}/tampered/step-3/__0_0.distcp fails its CRC-32 check"],
        CONVERT,
    ),
    case(
        "convert-checkpoint-other-flavor",
        ["dcp-to-hf", "{d}/other_flavor/step-3", "{d}/out", "--model.flavor", "tiny"],
        ["Checkpoint {d}/other_flavor/step-3", "model.flavor"],
        CONVERT,
    ),
    case(
        "convert-output-not-empty",
        ["dcp-to-hf", "{d}/other_flavor/step-3", "{d}/full_output", "--model.flavor", "debugmodel"],
        ["Output {d}/full_output already exists"],
        CONVERT,
    ),
    case(
        "convert-checkpoint-without-manifest",
        ["dcp-to-hf", "{d}/unverified/step-3", "{d}/out", "--model.flavor", "debugmodel"],
        ["dcp-to-hf CKPT_STEP_DIR", "{d}/unverified/step-3 has no manifest.json", "checkpoint.allow_unverified"],
        CONVERT,
    ),
    case("convert-hf-folder-missing", ["hf-to-dcp", "{d}/no_hf", "{d}/out"], ["{d}/no_hf does not exist"], CONVERT),
    case(
        "convert-hf-folder-into-a-mup-model",
        ["hf-to-dcp", "{d}/hf_llama", "{d}/out", "--model.flavor", "tiny", "--model.n_layers", "3", *MUP],
        ["hf-to-dcp HF_DIR = {d}/hf_llama is a Hugging Face folder, with model.parametrization = 'mup'"],
        CONVERT,
    ),
    case(
        "convert-hf-folder-unknown-config-field",
        ["hf-to-dcp", "{d}/hf_unknown_field", "{d}/out", *FROM_HF],
        ["sliding_window = 16 is a field torchpre's llama3 does not know"],
        CONVERT,
    ),
    # Data preparation.
    case(
        "prepare-input-missing",
        ["no/such.txt", "--output", "{d}/prepared"],
        ["Input 'no/such.txt' does not exist"],
        PREPARE,
    ),
    case("prepare-no-output", ["{d}/text.txt"], ["--output"], PREPARE),
    case(
        "prepare-output-is-a-file",
        ["{d}/text.txt", "--output", "{d}/a_file"],
        ["--output {d}/a_file is a file"],
        PREPARE,
    ),
]


# Folders and files from others (issue 60), from tests/foreign_cases.py's tables: a symbolic link in place of each file
# of a Hugging Face or shard folder, every config.json and shard manifest field of the wrong type or range, indexes
# and safetensors headers of the wrong form, JSON bombs in each JSON format, malformed tokenizer lines.
CATALOGUE += [case(case_id, argv, fragments, entry) for case_id, argv, fragments, entry in foreign_cases.CASES]


def error_lines(output: str) -> list[str]:
    """The one-line messages of the entry points (`error (rank R): ...`) or of argparse (`PROG: error: ...`)."""
    return [line for line in output.splitlines() if line.startswith("error (rank ") or ": error: " in line]


@pytest.mark.parametrize("entry, argv, fragments, ranks", CATALOGUE)
def test_bad_input_fails_fast_with_one_message(server, files, tmp_path, entry, argv, fragments, ranks):
    """Exit 2, no traceback, under a minute, and on every rank one line holding every fragment."""
    argv = [arg.format(d=files) for arg in argv]
    if entry == "train.py":
        argv = [*TINY, "--job.dump_folder", str(tmp_path / "out"), *argv]
    for rank in range(ranks):
        # A worker of a `torchrun --nproc-per-node ranks` launch, or a plain `python` process for one rank.
        names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
        launch = dict(zip(names, map(str, (rank, rank, ranks, ranks)))) if ranks > 1 else dict.fromkeys(names)
        env = launch | {"MASTER_ADDR": None, "MASTER_PORT": None, "TORCHELASTIC_ERROR_FILE": None}
        result = server.run(entry, argv, env)
        output = result.stdout + result.stderr
        assert result.returncode == EXIT_BAD_INPUT, output[-3000:]
        assert "Traceback" not in output, output[-3000:]
        assert result.seconds < LIMIT_S
        lines = error_lines(result.stderr)
        assert len(lines) == 1, result.stderr
        assert ranks == 1 or lines[0].startswith(f"error (rank {rank}): ")
        for fragment in fragments:
            assert fragment.format(d=files) in lines[0], f"{fragment!r} not in:\n{lines[0]}"
    assert not (files / "marker").exists(), "a hostile file's code ran"


DRY_RUN_CASES = ("tp-does-not-divide-heads", "sequence-parallel-seq-len", "pp-too-few-microbatches", "global-batch-dp2")


@pytest.mark.parametrize("entry, argv, fragments, ranks", [param for param in CATALOGUE if param.id in DRY_RUN_CASES])
def test_a_dry_run_stops_on_the_same_bad_input(server, files, tmp_path, entry, argv, fragments, ranks):
    """One process playing the launch's world with the fake process group meets the same check, same message."""
    argv = [*TINY, "--job.dump_folder", str(tmp_path / "out"), *argv]
    argv += ["--job.dry_run", "--job.dry_run_world_size", str(ranks)]
    env = dict.fromkeys(("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    result = server.run(entry, argv, env)
    assert result.returncode == EXIT_BAD_INPUT, (result.stdout + result.stderr)[-3000:]
    lines = error_lines(result.stderr)
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in:\n{lines[0]}"
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


def test_a_dry_run_names_the_rank_that_does_not_fit(server, tmp_path):
    """70B on one 80 GB GPU: exit 2, naming rank 0, its parts and the largest one."""
    argv = ["--model.flavor", "70B", "--training.seq_len", "64", "--training.local_batch_size", "1"]
    argv += ["--parallelism.data_parallel_degree", "1", "--job.dry_run", "--job.dry_run_gpu", "h100-80gb"]
    argv += ["--job.dump_folder", str(tmp_path / "out")]
    env = dict.fromkeys(("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    result = server.run("train.py", argv, env)
    assert result.returncode == EXIT_BAD_INPUT, (result.stdout + result.stderr)[-3000:]
    (line,) = error_lines(result.stderr)
    for fragment in ("rank 0 (pp 0, dp 0, tp 0) needs", "optimizer state", "h100-80gb", "optimizer.zero_stage"):
        assert fragment in line, line
    assert "params" in result.stdout and "optim" in result.stdout  # the table is printed before the verdict


def test_catalogue_covers_every_entry_point():
    entries = {param.values[0] for param in CATALOGUE}
    assert entries == {"train.py", "torchpre.train", "torchpre.generate", "torchpre.convert", "torchpre.data.prepare",
                       "torchpre.plan"}  # fmt: skip
    assert len(CATALOGUE) >= 25


# Real torchrun launches: torchrun's view of the failure, before and after the process group is up -------


@pytest.mark.parametrize(
    "args, fragments",
    [
        pytest.param(["--parallelism.data_parallel_degree", "3"], ["3 x 1 x 1 = 3", "2 launched"], id="layout"),
        pytest.param(
            [*TEXT, "--checkpoint.enable", "--checkpoint.folder", "{d}/run/checkpoint", "--checkpoint.load_step", "5"],
            ["checkpoint.load_step = 5", "complete steps: 2"],
            id="load-step-after-the-process-group",
        ),
    ],
)
def test_every_torchrun_worker_exits_with_the_message(files, tmp_path, args, fragments):
    start = time.monotonic()
    result = run_train(
        [*TINY, *(arg.format(d=files) for arg in args)], 2, tmp_path, timeout=LIMIT_S, launcher="torchrun"
    )
    assert time.monotonic() - start < LIMIT_S
    assert result.returncode != 0, result.stdout[-3000:]
    # torchrun prints its own launcher traceback when a worker fails; no frame of our code may show.
    assert 'train.py", line' not in result.stderr and "/torchpre/" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error (rank ")]
    assert sorted(line[:14] for line in lines) == ["error (rank 0)", "error (rank 1)"], result.stderr
    for line in lines:
        for fragment in fragments:
            assert fragment.format(d=files) in line, f"{fragment!r} not in:\n{line}"
    assert "error_file: <N/A>" not in result.stderr  # torchrun's summary shows our message
