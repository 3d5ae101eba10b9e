"""Hostile copies of the folders and files torchpre reads from others, for tests/integration/test_bad_input.py's
catalogue (issue 60): Hugging Face folders, shard folders, config.json files, eval task files, text inputs and
tokenizers. Each is a genuine one changed one way, made from a table, so that a new field or file is one row:

- a symbolic link in place of each file of a folder (and of a subfolder on the way), to a file of the same bytes
  outside it: read through the link, the folder would load;
- each config.json field torchpre reads, with values of the wrong type or range (`HF_FIELDS`);
- each field of a shard manifest (`MANIFEST_FIELDS`), an index of the wrong form (`INDEXES`), safetensors files
  whose headers safetensors refuses or torchpre cannot use (`SAFETENSORS`);
- JSON bombs in each JSON format: 100,000 levels deep, a 5,000-digit integer, a file past its kind's bound
  (`BOMBS`; sparse, so no disk is used).

`build(d)` writes them under `d` (after test_bad_input's own files: it copies its genuine ones); `CASES` lists
(id, argv, fragments, entry) for each, `{d}` standing for `d` as in the catalogue.
"""

import dataclasses
import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scripts import tiny_tokenizer
from tests.hf_folders import weight_files, write_llama_folder
from torchpre.data.prepare import main as prepare
from torchpre.data.tokenizer import DEFAULT_TOKENIZER_PATH
from torchpre.interchange.folder import shard_file_name
from torchpre.json_input import LIMITS
from torchpre.models.deepseek_v3 import hf as deepseek_hf
from torchpre.models.llama3 import hf as llama_hf
from torchpre.models.llama3.args import LLAMA3_FLAVORS
from torchpre.models.registry import get_flavor

TRAIN, CONVERT, PLAN, PREPARE = "train.py", "torchpre.convert", "torchpre.plan", "torchpre.data.prepare"
FROM_HF = ["--model.flavor", "from_hf", "--checkpoint.initial_load_path"]
DEEPSEEK_FROM_HF = ["--model.name", "deepseek_v3", *FROM_HF]
SHARDS = ["--training.dataset", "shards", "--training.dataset_path"]
TEXT = ["--training.dataset", "text", "--training.dataset_path"]
LINK = "is, or leads through, a symbolic link"
INDEX = "model.safetensors.index.json"
REPO = Path(__file__).resolve().parents[1]
SPLIT = "hf_split"  # a Llama folder of several safetensors files and an index: the links' genuine folder
SPLIT_ARGS, SPLIT_BYTES = dataclasses.replace(LLAMA3_FLAVORS["tiny"], n_layers=3), 300_000
SPLIT_FILES = [shard_file_name(n, len(weight_files(SPLIT_ARGS, SPLIT_BYTES)))
               for n in range(1, len(weight_files(SPLIT_ARGS, SPLIT_BYTES)) + 1)]  # fmt: skip

Case = tuple[str, list[str], list[str], str]
CASES: list[Case] = []


def _case(case_id: str, argv: list[str], fragments: list[str], entry: str = TRAIN) -> None:
    CASES.append((case_id, argv, fragments, entry))


def _literal(text: str) -> str:
    """`text` as a catalogue fragment (formatted with d=...): its braces kept."""
    return text.replace("{", "{{").replace("}", "}}")


def shown(value: Any) -> str:
    """A JSON value as torchpre's messages show it (`torchpre.models.hf_fields.shown`)."""
    text = json.dumps(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def _edit_json(path: Path, edit: Callable[[dict], Any]) -> None:
    record = json.loads(path.read_text())
    edit(record)
    path.write_text(json.dumps(record))


def _set(record: dict, dotted: str, value: Any) -> None:
    """Sets the field at the dotted path (list items by index: "shards.0.name")."""
    *parents, last = dotted.split(".")
    for key in parents:
        record = record[int(key)] if isinstance(record, list) else record[key]
    record[int(last) if isinstance(record, list) else last] = value


def _link_out(folder: Path, name: str, outside: Path) -> None:
    """Moves `folder/name` to `outside/...` and puts a symbolic link to it in its place: through the link the folder
    reads the same bytes."""
    target = outside / folder.name / name
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(folder / name, target)
    (folder / name).symlink_to(target)


# Symbolic links in place of a folder's files and subfolders -----------------------------------------------------


def _hf_links(d: Path) -> None:
    """A link in place of config.json, of the index, of each weights file, and of the subfolder holding them; the
    single-file layout's model.safetensors (no index to check it against)."""
    outside = d / "outside"
    for number, name in enumerate(["config.json", INDEX, *SPLIT_FILES]):
        _link_out(shutil.copytree(d / SPLIT, d / f"hf_link_{number}"), name, outside)
    single = shutil.copytree(d / "hf_llama", d / "hf_link_single")
    (single / INDEX).unlink()
    next(single.glob("model-*.safetensors")).rename(single / "model.safetensors")
    _link_out(single, "model.safetensors", outside)
    for kind in ("subfolder", "file_in_subfolder"):
        folder = shutil.copytree(d / SPLIT, d / f"hf_link_{kind}")
        (folder / "weights").mkdir()
        for path in folder.glob("model-*.safetensors"):
            path.rename(folder / "weights" / path.name)
        _edit_json(folder / INDEX, lambda index: index.update(
            weight_map={tensor: f"weights/{file}" for tensor, file in index["weight_map"].items()}))  # fmt: skip
        _link_out(folder, "weights" if kind == "subfolder" else f"weights/{SPLIT_FILES[-1]}", outside)


def _hf_link_cases() -> None:
    folders = [(f"hf_link_{number}", name) for number, name in enumerate(["config.json", INDEX, *SPLIT_FILES])]
    folders += [("hf_link_single", "model.safetensors"), ("hf_link_subfolder", f"weights/{SPLIT_FILES[0]}"),
                ("hf_link_file_in_subfolder", f"weights/{SPLIT_FILES[-1]}")]  # fmt: skip
    for folder, name in folders:
        fragments = [f"{{d}}/{folder}/{name}", LINK]
        what = name.replace("/", "-").removesuffix("-")
        _case(f"hf-link-{what}-hf-to-dcp", ["hf-to-dcp", f"{{d}}/{folder}", "{d}/out", "--model.flavor", "from_hf"],
              fragments, CONVERT)  # fmt: skip
        _case(f"hf-link-{what}-from-hf", [*FROM_HF, f"{{d}}/{folder}"], fragments)
        _case(f"hf-link-{what}-initial-load", ["--model.n_layers", "3", "--checkpoint.initial_load_path",
                                                f"{{d}}/{folder}"], fragments)  # fmt: skip
    _case("hf-link-config.json-plan", [*FROM_HF, "{d}/hf_link_0", "--gpus", "1"], ["{d}/hf_link_0/config.json", LINK],
          PLAN)  # fmt: skip


def _shard_links(d: Path) -> None:
    """A link in place of the manifest, the .bin, and of the subfolder holding them (training never opens a .idx:
    tests/unit/test_shard_data.py::test_thousands_of_shards_are_read_through_one_folder_descriptor_and_a_bounded_few_of_their_own;
    `ShardReader.document` refuses a link there, tests/unit/test_foreign_inputs.py)."""
    outside = d / "outside"
    for name in ("manifest.json", "part-0.bin"):
        _link_out(shutil.copytree(d / "shards", d / f"shards_link_{name}"), name, outside)
    for kind, name in (("subfolder", "sub"), ("file_in_subfolder", "sub/part-0.bin")):
        folder = shutil.copytree(d / "shards", d / f"shards_link_{kind}")
        (folder / "sub").mkdir()
        for suffix in (".bin", ".idx"):
            (folder / f"part-0{suffix}").rename(folder / "sub" / f"part-0{suffix}")
        _edit_json(folder / "manifest.json", lambda manifest: _set(manifest, "shards.0.name", "sub/part-0"))
        _link_out(folder, name, outside)
    prepare(["{}".format(d / "text.txt"), "--output", str(d / "prepared"), "--workers", "1"])
    for name in ("manifest.json", "shard_00000.bin"):
        _link_out(shutil.copytree(d / "prepared", d / f"prepared_link_{name}"), name, outside)


def _shard_link_cases() -> None:
    for name, path in (("manifest.json", "manifest.json"), ("part-0.bin", "part-0.bin"),
                       ("subfolder", "sub/part-0.bin"), ("file_in_subfolder", "sub/part-0.bin")):  # fmt: skip
        _case(f"shards-link-{name}", [*SHARDS, f"{{d}}/shards_link_{name}"], [f"{{d}}/shards_link_{name}/{path}", LINK])
    for name in ("manifest.json", "shard_00000.bin"):
        _case(f"prepare-resume-link-{name}", ["{d}/text.txt", "--output", f"{{d}}/prepared_link_{name}"],
              [f"{{d}}/prepared_link_{name}/{name}", LINK], PREPARE)  # fmt: skip


# A FIFO in place of a file: opened without O_NONBLOCK, a read would wait forever for a writer.
FIFOS = {
    "hf-config": ("fifo_hf_config", "config.json", [*FROM_HF, "{d}/fifo_hf_config"], TRAIN),
    "hf-weights": ("fifo_hf_weights", SPLIT_FILES[0], [*FROM_HF, "{d}/fifo_hf_weights"], TRAIN),
    "hf-config-plan": ("fifo_hf_config", "config.json", [*FROM_HF, "{d}/fifo_hf_config", "--gpus", "1"], PLAN),
    "shard-manifest": ("fifo_shards_manifest", "manifest.json", [*SHARDS, "{d}/fifo_shards_manifest"], TRAIN),
    "shard-tokens": ("fifo_shards_tokens", "part-0.bin", [*SHARDS, "{d}/fifo_shards_tokens"], TRAIN),
    "eval-task": ("fifo_task", "task.jsonl", ["--eval.tasks", "{d}/fifo_task/task.jsonl"], TRAIN),
    "tokenizer": ("fifo_tokenizer", "tokenizer.model", ["--model.tokenizer_path", "{d}/fifo_tokenizer/tokenizer.model"],
                  TRAIN),
    "tokenizer.json": ("fifo_tokenizer_json", "tokenizer.json", ["--model.tokenizer_path", "{d}/fifo_tokenizer_json"],
                       TRAIN),
    "tokenizer_config.json": ("fifo_tokenizer_config", "tokenizer_config.json",
                              ["--model.tokenizer_path", "{d}/fifo_tokenizer_config"], TRAIN),
}  # fmt: skip


def _fifos(d: Path) -> None:
    sources = {"fifo_hf_config": d / SPLIT, "fifo_hf_weights": d / SPLIT, "fifo_shards_manifest": d / "shards",
               "fifo_shards_tokens": d / "shards", "fifo_tokenizer_config": d / TOKENIZER}  # fmt: skip
    for folder, name, _, _ in FIFOS.values():
        if (d / folder).exists():
            continue
        shutil.copytree(sources[folder], d / folder) if folder in sources else (d / folder).mkdir()
        (d / folder / name).unlink(missing_ok=True)
        os.mkfifo(d / folder / name)


def _fifo_cases() -> None:
    for name, (folder, file, argv, entry) in FIFOS.items():
        _case(f"fifo-{name}", argv, [f"{{d}}/{folder}/{file}", "not a regular file"], entry)


def _input_links(d: Path) -> None:
    """A folder of text (training.dataset_path, a prepare INPUT) holding a link to a file outside it. (A file a key
    or argument names may be a link, the user's choice: tests/unit/test_confined.py.)"""
    for name in ("text_folder_link", "prepare_folder_link"):
        (d / name).mkdir()
        (d / name / "a.txt").write_text("The quick brown fox jumps over the lazy dog. " * 300)
        (d / name / "b.txt").symlink_to(d / "text.txt")


def _input_link_cases() -> None:
    _case("text-folder-link", [*TEXT, "{d}/text_folder_link"], ["{d}/text_folder_link/b.txt", LINK])
    _case("prepare-input-folder-link", ["{d}/prepare_folder_link", "--output", "{d}/prepared_from_link"],
          ["{d}/prepare_folder_link/b.txt", LINK], PREPARE)  # fmt: skip


# config.json fields of the wrong type or range -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Field:
    """Bad values of one config.json field (a dotted path), and the message's fragment when it is not the
    generic `FIELD is VALUE`."""

    name: str
    values: tuple[Any, ...]
    fragment: str = ""


_LLAMA_RULE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # fmt: skip
HF_FIELDS: dict[str, tuple[Field, ...]] = {
    "llama3": (
        Field("num_attention_heads", (0, -4, "4", 4.0, None)),
        Field("hidden_size", ("256", 0, 64.5, True)),
        Field("num_hidden_layers", (0, "3")),
        Field("num_key_value_heads", (0, "2")),
        Field("num_key_value_heads", (3,), "num_attention_heads = 4 is not divisible by num_key_value_heads = 3"),
        Field("num_attention_heads", (3,), "hidden_size = 64 is not divisible by num_attention_heads = 3"),
        Field("intermediate_size", (0, [176])),
        Field("vocab_size", (0, -1, "2048")),
        Field("head_dim", (0, "16")),
        Field("rms_norm_eps", (0, -1e-5, "1e-5", float("nan"))),
        Field("rope_theta", (0, "500000", float("inf"))),
        Field("rope_scaling", ([1, 2], "llama3", 5)),
        Field("rope_parameters", (["llama3"],)),
        Field("rope_scaling.rope_type", (["llama3"], 3)),
        Field("rope_scaling.factor", ("8", 0)),
        Field("rope_scaling.original_max_position_embeddings", (0, 8192.5)),
        Field("max_position_embeddings", (0, "2048")),
        Field("tie_word_embeddings", ("false", 0)),
        Field("quantization_config", ("fp8", [1])),
    ),
    "deepseek_v3": (
        Field("num_attention_heads", (0, "4")),
        Field("hidden_size", ("64",)),
        Field("kv_lora_rank", ("32", 0)),
        Field("q_lora_rank", (-1, "32")),
        Field("n_routed_experts", (0, 8.0)),
        Field("n_group", (3,), "n_routed_experts = 8 is not divisible by n_group = 3"),
        Field("num_experts_per_tok", ("2",)),
        Field("norm_topk_prob", ("true",)),
        Field("routed_scaling_factor", (0, "2.5")),
        Field("aux_loss_alpha", (-1,)),
        Field("first_k_dense_replace", (-1,)),
        Field("rope_parameters", ([1],)),
        Field("rope_parameters.rope_type", ([1],)),
        Field("max_position_embeddings", ("4096",)),
        Field("quantization_config", ("fp8",)),
    ),
    "hf": (
        Field("num_attention_heads", (0, "4")),
        Field("hidden_size", ("256", -64)),
        Field("num_key_value_heads", (3,), "num_attention_heads = 4 is not divisible by num_key_value_heads = 3"),
        Field("vocab_size", (-5,)),
        Field("rms_norm_eps", ("1e-6",)),
        Field("rope_scaling", ([1, 2],)),
        Field("quantization_config", ("fp8",)),
        Field("tie_word_embeddings", ("no",)),
        Field("attention_dropout", ("0.1", -0.5)),
        Field("attention_dropout", (1,), "attention_dropout = 1: a random training forward"),
    ),
}


def _base_configs() -> dict[str, dict]:
    """The genuine config.json of each format: a Llama folder's, a DeepSeek-V3 folder's (the debug model with the
    tokenizer's vocabulary) and model.hf_config's shipped Llama."""
    tokens = {"bos_token_id": 2046, "eos_token_id": 2047, "torch_dtype": "bfloat16"}
    return {
        "llama3": llama_hf.hf_config(SPLIT_ARGS, **tokens),
        "deepseek_v3": deepseek_hf.hf_config(get_flavor("deepseek_v3", "debugmodel"), **tokens),
        "hf": json.loads((REPO / "assets/hf_configs/llama_tiny.json").read_text()),
    }


def bad_config(family: str, name: str, value: Any) -> dict:
    """The genuine config.json of `family` with the field `name` (a dotted path) set to `value`."""
    config = _base_configs()[family]
    if name.startswith("rope_scaling.") and family == "llama3":
        config["rope_scaling"] = dict(_LLAMA_RULE)
    _set(config, name, value)
    return config


def _field_files(d: Path) -> None:
    for family in HF_FIELDS:
        for number, (name, value, _) in enumerate(field_rows(family)):
            config = bad_config(family, name, value)
            folder = d / f"field_{family}_{number}"
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps(config))
            (folder / "model.safetensors").write_bytes(b"")  # never read: the config is refused first
    # A size of its kind, but past what a tensor can hold: refused when the model is sized, before any file is read.
    huge = d / "field_llama3_huge_vocab"
    huge.mkdir()
    (huge / "config.json").write_text(json.dumps(bad_config("llama3", "vocab_size", 10**25)))
    (huge / "model.safetensors").write_bytes(b"")


def field_rows(family: str) -> list[tuple[str, Any, str]]:
    return [(field.name, value, field.fragment) for field in HF_FIELDS[family] for value in field.values]


def _field_cases() -> None:
    for family in HF_FIELDS:
        for number, (name, value, fragment) in enumerate(field_rows(family)):
            folder = f"{{d}}/field_{family}_{number}"
            message = _literal(fragment or f"{name} is {shown(value)}")
            case_id = f"hf-field-{family}-{name}-{shown(value)}".replace(" ", "")
            if family == "hf":
                _case(case_id, ["--model.name", "hf", "--model.hf_config", f"{folder}/config.json"],
                      [f"model.hf_config = {folder}/config.json", message])  # fmt: skip
            else:
                argv = FROM_HF if family == "llama3" else DEEPSEEK_FROM_HF
                _case(case_id, [*argv, folder], [f"{folder}/config.json", message])
    _case("hf-field-llama3-vocab_size-past-int64", [*FROM_HF, "{d}/field_llama3_huge_vocab"],
          ["{d}/field_llama3_huge_vocab/config.json", "describes a model whose tensors no machine can hold"])
    _case("hf-field-plan", [*FROM_HF, "{d}/field_llama3_0", "--gpus", "1"],
          ["{d}/field_llama3_0/config.json", "num_attention_heads is 0, not a positive integer"], PLAN)  # fmt: skip


# Indexes, safetensors headers and shard manifests of the wrong form ---------------------------------------------

INDEXES: dict[str, tuple[Callable[[dict], Any], str]] = {
    "a-list": (lambda index: [index], "is not a safetensors index ('the file' is [{"),
    "weight-map-a-list": (lambda index: {"weight_map": list(index["weight_map"])}, "'weight_map' is ["),
    "file-name-a-number": (lambda index: _replaced(index, 5), "'weight_map.model.norm.weight' is 5, not a string"),
    "file-name-absolute": (lambda index: _replaced(index, "/etc/passwd"), "is an absolute path"),
    "file-name-empty": (lambda index: _replaced(index, ""), "is not a file name"),
    "file-name-a-folder": (lambda index: {"weight_map": dict.fromkeys(index["weight_map"], "sub")}, "sub is a folder"),
    "file-name-not-safetensors": (lambda index: _replaced(index, "config.json"), "is not a readable safetensors"),
}


def _replaced(index: dict, file: Any) -> dict:
    return {**index, "weight_map": {**index["weight_map"], "model.norm.weight": file}}


def _tensor_header(dtype: str, shape: list[int], offsets: list[int]) -> dict:
    return {"model.norm.weight": {"dtype": dtype, "shape": shape, "data_offsets": offsets}}


SAFETENSORS: dict[str, tuple[Callable[[], bytes], str]] = {
    "header-length-past-the-end": (lambda: struct.pack("<Q", 10**9) + b"{}", "is not a readable safetensors file"),
    "header-length-2-63": (lambda: struct.pack("<Q", 2**63) + b"{}", "is not a readable safetensors file"),
    "header-not-json": (lambda: struct.pack("<Q", 10) + b"not json!!", "is not a readable safetensors file"),
    "offsets-past-the-end": (lambda: _safetensors(_tensor_header("F32", [64], [0, 10**6]), 256),
                             "is not a readable safetensors file"),  # fmt: skip
    "shape-overflowing": (lambda: _safetensors(_tensor_header("F32", [2**62, 2**62], [0, 256]), 256),
                          "is not a readable safetensors file"),  # fmt: skip
    "dtype-unknown": (lambda: _safetensors(_tensor_header("Q7", [64], [0, 256]), 256),
                      "is not a readable safetensors file"),  # fmt: skip
    "dtype-not-read": (lambda: _safetensors(_tensor_header("U16", [64], [0, 128]), 128),
                       "model.norm.weight is stored as U16, which torchpre does not read"),  # fmt: skip
    "header-nested-deep": (lambda: struct.pack("<Q", 200_000) + b"[" * 100_000 + b"]" * 100_000,
                           "is not a readable safetensors file"),  # fmt: skip
}


def _safetensors(header: dict, data_bytes: int) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + bytes(data_bytes)


def _index_and_header_files(d: Path) -> None:
    for name, (edit, _) in INDEXES.items():
        folder = shutil.copytree(d / "hf_llama", d / f"hf_index_{name}")
        (folder / "sub").mkdir()
        (folder / INDEX).write_text(json.dumps(edit(json.loads((folder / INDEX).read_text()))))
    for name, (content, _) in SAFETENSORS.items():
        folder = d / f"hf_header_{name}"
        folder.mkdir()
        shutil.copy(d / "hf_llama" / "config.json", folder / "config.json")
        (folder / "model.safetensors").write_bytes(content())


def _index_and_header_cases() -> None:
    for name, (_, fragment) in INDEXES.items():
        _case(f"hf-index-{name}", [*FROM_HF, f"{{d}}/hf_index_{name}"], [f"{{d}}/hf_index_{name}/", _literal(fragment)])
    for name, (_, fragment) in SAFETENSORS.items():
        _case(f"hf-safetensors-{name}", [*FROM_HF, f"{{d}}/hf_header_{name}"],
              [f"{{d}}/hf_header_{name}/model.safetensors", fragment])  # fmt: skip


MANIFEST_FIELDS: tuple[Field, ...] = (
    Field("version", ("1", 1.5, None), "'version' is "),
    Field("vocab_size", (-1, 2048.0, True), "'vocab_size' is "),
    Field("shards", ({}, "part-0", None), "'shards' is "),
    Field("shards.0", ("part-0", []), "'shards[0]' is "),
    Field("shards.0.name", (5, None), "'shards[0].name' is "),
    Field("shards.0.name", ("/etc/passwd", "a\\b", "x\u0000y", "", "a/../../b"), "shards[0].name names "),
    Field("shards.0.num_tokens", (-1, "10", 1.5), "'shards[0].num_tokens' is "),
    Field("shards.0.num_documents", (-1, None), "'shards[0].num_documents' is "),
    Field("shards.0.max_token_id", (-1, "5", 1.5), "'shards[0].max_token_id' is "),
    Field("complete", (1,), "'complete' is "),
    Field("source", ([], "x"), "'source' is "),
    Field("dtype", ("uint32", 5), "'dtype' is "),
    Field("tokenizer_name", (None, 5), "'tokenizer_name' is "),
)


def _manifest_rows() -> list[tuple[str, Any, str]]:
    return [(field.name, value, field.fragment) for field in MANIFEST_FIELDS for value in field.values]


def _manifest_files(d: Path) -> None:
    for number, (name, value, _) in enumerate(_manifest_rows()):
        folder = shutil.copytree(d / "shards", d / f"shards_field_{number}")
        _edit_json(folder / "manifest.json", lambda manifest: _set(manifest, name, value))
    # A manifest claiming more ids than the model's embedding has rows, over a file holding one (3,000) past them:
    # its per-shard largest id unrecorded, as in manifests from before it was recorded.
    larger = shutil.copytree(d / "shards", d / "shards_larger_vocab")
    _edit_json(larger / "manifest.json", lambda manifest: (manifest.update(vocab_size=4096),
                                                          manifest["shards"][0].pop("max_token_id")))  # fmt: skip
    with open(larger / "part-0.bin", "r+b") as file:  # uint16 ids: the 11th token becomes 3,000
        file.seek(20)
        file.write((3000).to_bytes(2, "little"))


def _manifest_cases() -> None:
    for number, (name, value, fragment) in enumerate(_manifest_rows()):
        case_id = f"shards-field-{name}-{shown(value)}".replace(" ", "")
        _case(case_id, [*SHARDS, f"{{d}}/shards_field_{number}"],
              [f"{{d}}/shards_field_{number}/manifest.json", _literal(fragment)])  # fmt: skip
    _case("shards-manifest-claims-a-larger-vocabulary", [*SHARDS, "{d}/shards_larger_vocab"],
          ["{d}/shards_larger_vocab/manifest.json: vocab_size = 4,096", "2,048 rows of the model's embedding"])


# JSON bombs in each JSON format ---------------------------------------------------------------------------------

DEEP = b"[" * 100_000 + b"]" * 100_000
DIGITS = b'{"vocab_size": 1' + b"0" * 5_000 + b"}"
# Each JSON format: where its file goes, the LIMITS kind that bounds it (a file of records: "line") and the command.
JSON_FORMATS: dict[str, tuple[str, str, list[str], str]] = {
    "config.json": ("bomb_config_{bomb}/config.json", "config", [*FROM_HF, "{d}/bomb_config_{bomb}"], TRAIN),
    "index": (f"bomb_index_{{bomb}}/{INDEX}", "index", [*FROM_HF, "{d}/bomb_index_{bomb}"], TRAIN),
    "model.hf_config": ("bomb_hf_config_{bomb}.json", "config",
                        ["--model.name", "hf", "--model.hf_config", "{d}/bomb_hf_config_{bomb}.json"], TRAIN),
    "shard-manifest": ("bomb_shards_{bomb}/manifest.json", "shard_manifest", [*SHARDS, "{d}/bomb_shards_{bomb}"],
                       TRAIN),
    "prepare-resumed-manifest": ("bomb_prepared_{bomb}/manifest.json", "shard_manifest",
                                 ["{d}/text.txt", "--output", "{d}/bomb_prepared_{bomb}"], PREPARE),
    "eval-task": ("bomb_task_{bomb}.jsonl", "line", ["--eval.tasks", "{d}/bomb_task_{bomb}.jsonl"], TRAIN),
    "text-jsonl": ("bomb_text_{bomb}.jsonl", "line", [*TEXT, "{d}/bomb_text_{bomb}.jsonl"], TRAIN),
    "prepare-jsonl": ("bomb_input_{bomb}.jsonl", "line", ["{d}/bomb_input_{bomb}.jsonl", "--output", "{d}/bomb_out"],
                      PREPARE),
    "tokenizer.json": ("bomb_tokenizer_{bomb}/tokenizer.json", "tokenizer",
                       ["--model.tokenizer_path", "{d}/bomb_tokenizer_{bomb}"], TRAIN),
    "tokenizer_config.json": ("bomb_tokenizer_config_{bomb}/tokenizer_config.json", "config",
                              ["{d}/text.txt", "--output", "{d}/bomb_out", "--tokenizer",
                               "{d}/bomb_tokenizer_config_{bomb}"], PREPARE),
}  # fmt: skip
BOMBS = {
    "deep": (lambda limit: DEEP, "nests more than a thousand levels deep"),
    "digits": (lambda limit: DIGITS, "holds an integer of 5,001 digits"),
    "large": (lambda limit: None, "bytes"),  # a sparse file of max(limit + 1, 300 MB) bytes
}


def _bomb_files(d: Path) -> None:
    for name, (where, kind, _, _) in JSON_FORMATS.items():
        for bomb, (content, _) in BOMBS.items():
            path = d / where.format(bomb=bomb)
            if path.parent != d:
                source = {"index": d / "hf_llama", "shard-manifest": d / "shards",
                          "tokenizer_config.json": d / TOKENIZER}.get(name)  # fmt: skip
                shutil.copytree(source, path.parent) if source else path.parent.mkdir()
                if name == "config.json":
                    (path.parent / "model.safetensors").write_bytes(b"")
            data = content(LIMITS[kind])
            if data is None:
                with open(path, "wb") as file:
                    file.truncate(max(LIMITS[kind] + 1, 300 * 10**6))
            else:
                path.write_bytes(data + b"\n")


def _bomb_cases() -> None:
    for name, (where, kind, argv, entry) in JSON_FORMATS.items():
        for bomb, (_, fragment) in BOMBS.items():
            path = "{d}/" + where.format(bomb=bomb)
            if bomb == "large" and kind == "line":
                fragment = f"(line 1) holds more than {LIMITS['line']:,} bytes"
            elif bomb == "large":
                fragment = f"a file of this kind holds at most {LIMITS[kind]:,}"
            _case(f"json-bomb-{name}-{bomb}", [arg.format(d="{d}", bomb=bomb) for arg in argv], [path, fragment], entry)


# Tokenizer files --------------------------------------------------------------------------------------------------

TOKENIZER_LINES = {
    "rank-of-5000-digits": b"YQ== 1" + b"0" * 4_999,
    "rank-negative": b"YQ== -1",
    "rank-with-underscore": b"YQ== 1_0",
    "three-fields": b"YQ== 1 2",
    "token-not-base64": b"Y!Q= 1",
}


def _changed(change: Callable[[Any], Any]) -> Callable[[Any], str]:
    """The text of a JSON file once `change` has changed its parsed value in place."""

    def text(record: Any) -> str:
        change(record)
        return json.dumps(record)

    return text


# A post-processor that adds two tokens before a text (as BERT's adds [CLS] and [SEP] around one).
_SPECIAL = {"id": "<s>", "type_id": 0}
TWO_BEFORE = {
    "type": "TemplateProcessing",
    "single": [{"SpecialToken": _SPECIAL}, {"SpecialToken": _SPECIAL}, {"Sequence": {"id": "A", "type_id": 0}}],
    "pair": [{"SpecialToken": _SPECIAL}, {"Sequence": {"id": "A", "type_id": 0}},
             {"Sequence": {"id": "B", "type_id": 0}}],
    "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
}
# A Hugging Face tokenizer folder (tokenizer.json and tokenizer_config.json, Mistral's kind: BOS added), changed one
# way each: (the file, its new text from its parsed JSON, the message's fragment).
TOKENIZER_EDITS: dict[str, tuple[str, Callable[[Any], str], str]] = {
    "malformed-json": ("tokenizer.json", lambda spec: '{"model": {"type": "BPE",', "is not valid JSON"),
    "unknown-model-type": ("tokenizer.json", _changed(lambda spec: _set(spec, "model.type", "SentencePiece")),
                           "'model.type' is 'SentencePiece', not one of the tokenizers library's"),
    "no-model": ("tokenizer.json", _changed(lambda spec: spec.pop("model")), "'model' is missing"),
    "id-past-int32": ("tokenizer.json", _changed(lambda spec: _set(spec, "added_tokens.0.id", 2**40)),
                      "'added_tokens[0].id' is 1099511627776, not a token id"),
    "bpe-dropout": ("tokenizer.json", _changed(lambda spec: _set(spec, "model.dropout", 0.1)),
                    "'model.dropout' is 0.1"),
    "library-refuses": ("tokenizer.json", _changed(lambda spec: spec.update(normalizer={"type": "NoSuchNormalizer"})),
                        "the tokenizers library cannot read it"),
    "two-tokens-before-a-text": ("tokenizer.json", _changed(lambda spec: spec.update(post_processor=TWO_BEFORE)),
                                 "torchpre frames a text with at most one token before it (BOS)"),
    "no-eos": ("tokenizer_config.json", _changed(lambda config: config.pop("eos_token")),
               "tokenizer_config.json names no eos_token, and its post_processor adds none"),
    "eos-not-a-token": ("tokenizer_config.json", _changed(lambda config: config.update(eos_token="<|not-a-token|>")),
                        "eos_token = '<|not-a-token|>' is not a token of"),
    "bos-object-not-a-token": ("tokenizer_config.json",
                               _changed(lambda config: config.update(bos_token={"content": "<nope>", "special": True})),
                               "bos_token = '<nope>' is not a token of"),
    "add-bos-disagrees": ("tokenizer_config.json", _changed(lambda config: config.update(add_bos_token=False)),
                          "add_bos_token = false, but the post_processor of"),
    "add-eos-a-string": ("tokenizer_config.json", _changed(lambda config: config.update(add_eos_token="yes")),
                         "'add_eos_token' is \"yes\", not true or false or null"),
    "config-not-an-object": ("tokenizer_config.json", lambda config: json.dumps([config]), "not an object"),
}  # fmt: skip
TOKENIZER = "tokenizer_hf"  # the genuine folder


def _tokenizer_files(d: Path) -> None:
    lines = DEFAULT_TOKENIZER_PATH.read_bytes().splitlines()
    for name, line in TOKENIZER_LINES.items():
        (d / f"tokenizer_{name}.model").write_bytes(b"\n".join([*lines[:5], line, *lines[5:]]) + b"\n")
    with open(d / "tokenizer_large.model", "wb") as file:
        file.truncate(LIMITS["tiktoken"] + 1)
    for name, (file, edit, _) in TOKENIZER_EDITS.items():
        path = shutil.copytree(d / TOKENIZER, d / f"tokenizer_{name}") / file
        path.write_text(edit(json.loads(path.read_text())))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        _link_out(shutil.copytree(d / TOKENIZER, d / f"tokenizer_link_{name}"), name, d / "outside")
    _edit_json(shutil.copytree(d / "hf_llama", d / "hf_vocab_500") / "config.json",
               lambda config: config.update(vocab_size=500))  # fmt: skip


def _tokenizer_cases() -> None:
    for name in TOKENIZER_LINES:
        _case(f"tokenizer-line-{name}", ["--model.tokenizer_path", f"{{d}}/tokenizer_{name}.model"],
              [f"Malformed line {{d}}/tokenizer_{name}.model:6"])  # fmt: skip
    _case("tokenizer-past-its-bound", ["--model.tokenizer_path", "{d}/tokenizer_large.model"],
          ["{d}/tokenizer_large.model", f"at most {LIMITS['tiktoken']:,}"])  # fmt: skip
    for name, (file, _, fragment) in TOKENIZER_EDITS.items():
        _case(f"tokenizer-json-{name}", ["--model.tokenizer_path", f"{{d}}/tokenizer_{name}"],
              [f"{{d}}/tokenizer_{name}/{file}", _literal(fragment)])  # fmt: skip
    _case("tokenizer-json-unknown-model-type-prepare",
          ["{d}/text.txt", "--output", "{d}/prepared_bad_tokenizer", "--tokenizer", "{d}/tokenizer_unknown-model-type"],
          ["{d}/tokenizer_unknown-model-type/tokenizer.json", "'model.type' is 'SentencePiece'"], PREPARE)  # fmt: skip
    for name in ("tokenizer.json", "tokenizer_config.json"):
        _case(f"tokenizer-link-{name}", ["--model.tokenizer_path", f"{{d}}/tokenizer_link_{name}"],
              [f"{{d}}/tokenizer_link_{name}/{name}", LINK])  # fmt: skip
    _case("tokenizer-json-without-bos-under-the-document-mask",
          ["--model.tokenizer_path", "{d}/tokenizer_hf_no_bos", "--training.document_mask"],
          ["training.document_mask", "the tokenizer {d}/tokenizer_hf_no_bos starts documents with none"])  # fmt: skip
    _case("tokenizer-json-larger-than-the-embedding",
          [*FROM_HF, "{d}/hf_vocab_500", "--model.tokenizer_path", f"{{d}}/{TOKENIZER}"],
          [f"The tokenizer {{d}}/{TOKENIZER} (model.tokenizer_path) has 800 ids, more than the 500 rows of the "
           "embedding of {d}/hf_vocab_500"])  # fmt: skip


def build(d: Path) -> None:
    """Writes every file of `CASES` under `d`, which holds test_bad_input's genuine files (hf_llama, shards,
    text.txt)."""
    write_llama_folder(d / SPLIT, SPLIT_ARGS, shard_bytes=SPLIT_BYTES)
    _hf_links(d)
    _shard_links(d)
    _input_links(d)
    tiny_tokenizer.write("byte_fallback", d / TOKENIZER)
    tiny_tokenizer.write("byte_level", d / "tokenizer_hf_no_bos")  # Qwen's kind
    _fifos(d)
    _field_files(d)
    _index_and_header_files(d)
    _manifest_files(d)
    _bomb_files(d)
    _tokenizer_files(d)


def _register() -> None:
    _hf_link_cases()
    _shard_link_cases()
    _input_link_cases()
    _fifo_cases()
    _field_cases()
    _index_and_header_cases()
    _manifest_cases()
    _bomb_cases()
    _tokenizer_cases()


_register()

