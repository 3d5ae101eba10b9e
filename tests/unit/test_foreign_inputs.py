"""Files from others read as what was checked (issue 60): a safetensors file and a shard file are read through the
descriptor `confined.open_file` checked, even when the name is swapped for a link after the check; each config.json
field of the wrong kind is refused by name (the table of tests/foreign_cases.py, in process); shard token ids are
checked against the model's embedding rows, not the manifest's claim; JSON Lines records are bounded one by one.
The same inputs through the entry points (exit 2, one message): tests/integration/test_bad_input.py."""

import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tests import foreign_cases
from torchpre import json_input
from torchpre.data import shards
from torchpre.data.shard_dataset import ShardWindows
from torchpre.data.shards import Manifest, write_shard
from torchpre.data.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer
from torchpre.errors import TorchpreError, UntrustedInput
from torchpre.interchange import reader
from torchpre.interchange.reader import HFFolder
from torchpre.models.deepseek_v3.hf import args_from_hf_config as deepseek_args
from torchpre.models.hf.args import check_values
from torchpre.models.llama3.hf import args_from_hf_config as llama_args

TOKENIZER = load_tokenizer(DEFAULT_TOKENIZER_PATH)
SHA256 = TOKENIZER.sha256


def swapping_after_the_check(module, monkeypatch, name: str, replacement: Path) -> None:
    """`module.open_file` opening as before, then putting a symbolic link to `replacement` in place of the file
    `name`: what a folder's author racing the reader could do between the check and a second open by name."""
    opened = module.open_file

    def open_then_swap(folder: Path, file: str, *args, **kwargs):
        handle = opened(folder, file, *args, **kwargs)
        if file == name:
            os.replace(folder / file, folder / f".{file}.checked")
            (folder / file).symlink_to(replacement)
        return handle

    monkeypatch.setattr(module, "open_file", open_then_swap)


def test_safetensors_are_read_from_the_checked_descriptor_not_the_name(tmp_path, monkeypatch):
    """The name swapped for a link to other weights after the check: the folder still reads the checked file's."""
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    save_file({"w": torch.full((4, 4), 1.0)}, folder / "model.safetensors")
    save_file({"w": torch.full((4, 4), 7.0)}, tmp_path / "other.safetensors")
    weights = HFFolder(folder)
    swapping_after_the_check(reader, monkeypatch, "model.safetensors", tmp_path / "other.safetensors")
    with weights.reading():
        assert weights.read("w", ()).tolist() == [[1.0] * 4] * 4


def test_shard_tokens_are_read_from_the_checked_descriptor_not_the_name(tmp_path, monkeypatch):
    folder = tmp_path / "shards"
    folder.mkdir()
    info = write_shard(folder, "part-0", [[1, 2, 3, 4]], TOKENIZER.vocab_size)
    Manifest(DEFAULT_TOKENIZER_PATH.name, SHA256, TOKENIZER.vocab_size, [info]).write(folder)
    np.array([9, 9, 9, 9], dtype="<u2").tofile(tmp_path / "other.bin")
    swapping_after_the_check(shards, monkeypatch, "part-0.bin", tmp_path / "other.bin")
    assert shards.ShardReader(folder, TOKENIZER.vocab_size).document(0, 0).tolist() == [1, 2, 3, 4]


def test_a_documents_offsets_are_read_without_a_link_and_checked_against_the_manifest(tmp_path):
    """Training never opens a .idx; `ShardReader.document` does, refusing a link in its place and offsets that leave
    the shard's tokens, by name."""
    folder = tmp_path / "shards"
    folder.mkdir()
    info = write_shard(folder, "part-0", [[1, 2, 3, 4], [5, 6]], TOKENIZER.vocab_size)
    Manifest(DEFAULT_TOKENIZER_PATH.name, SHA256, TOKENIZER.vocab_size, [info]).write(folder)
    reader = shards.ShardReader(folder, TOKENIZER.vocab_size)
    assert [reader.document(0, i).tolist() for i in range(2)] == [[1, 2, 3, 4], [5, 6]]
    np.array([0, 4, 9], dtype="<i8").tofile(folder / "part-0.idx")
    with pytest.raises(TorchpreError, match=r"part-0\.idx: document 1 runs from token 4 to 9, outside the 6 tokens"):
        reader.document(0, 1)
    (tmp_path / "outside.idx").write_bytes((folder / "part-0.idx").read_bytes())
    (folder / "part-0.idx").unlink()
    (folder / "part-0.idx").symlink_to(tmp_path / "outside.idx")
    with pytest.raises(UntrustedInput, match=r"part-0\.idx .*symbolic link"):
        reader.document(0, 0)


def fp8_folder(folder: Path, block: list[int], weight: torch.Tensor, scales: torch.Tensor) -> HFFolder:
    folder.mkdir()
    config = {"quantization_config": {"quant_method": "fp8", "weight_block_size": block}}
    (folder / "config.json").write_text(json.dumps(config))
    tensors = {"w.weight": weight.to(torch.float8_e4m3fn), "w.weight_scale_inv": scales}
    save_file(tensors, folder / "model.safetensors")
    return HFFolder(folder)


def test_an_fp8_box_is_its_values_times_its_blocks_scales(tmp_path):
    """A box cutting blocks at both ends: each value times the scale of the 16 x 16 block it lies in."""
    weight = torch.randn(40, 40, generator=torch.Generator().manual_seed(0))
    scales = torch.arange(1.0, 10.0).reshape(3, 3)
    folder = fp8_folder(tmp_path / "fp8", [16, 16], weight, scales)
    whole = weight.to(torch.float8_e4m3fn).float() * scales.repeat_interleave(16, 0).repeat_interleave(16, 1)[:40, :40]
    with folder.reading():
        assert torch.equal(folder.read("w.weight", (slice(5, 37), slice(3, 30))), whole[5:37, 3:30].bfloat16())


def test_an_fp8_box_costs_the_box_whatever_block_size_the_config_claims(tmp_path):
    """Blocks of 2^40 x 2^40: one scale for the whole weight, never repeated over a block (2^80 values)."""
    weight = torch.ones(8, 8)
    folder = fp8_folder(tmp_path / "fp8", [2**40, 2**40], weight, torch.full((1, 1), 3.0))
    with folder.reading():
        assert folder.read("w.weight", (slice(2, 6),)).tolist() == [[3.0] * 8] * 4


FIELD_ROWS = [
    pytest.param(family, *row, id=f"{family}-{row[0]}-{json.dumps(row[1])}")
    for family in foreign_cases.HF_FIELDS
    for row in foreign_cases.field_rows(family)
]


@pytest.mark.parametrize("family, name, value, fragment", FIELD_ROWS)
def test_every_config_field_of_the_wrong_kind_is_refused_by_name(family, name, value, fragment):
    """tests/foreign_cases.py's table, each row read by the family's reader: an error naming the field and the
    value, before any arithmetic or constructor sees it."""
    config = foreign_cases.bad_config(family, name, value)
    read = {"llama3": llama_args, "deepseek_v3": deepseek_args, "hf": check_values}[family]
    if fragment.startswith("attention_dropout = 1"):  # a number: refused later, as random (test_bad_input)
        read(config)
        return
    with pytest.raises(TorchpreError) as error:
        read(config)
    assert (fragment or f"{name} is {foreign_cases.shown(value)}") in str(error.value)



def test_every_causal_lm_config_transformers_writes_passes_the_kinds():
    """The class the kinds must admit: the default config.json of every model type transformers maps to a causal LM,
    as transformers itself writes it (nulls for unset fields, a window of 0 turned off, a size per layer). A kind
    stricter than transformers refuses a genuine folder (Qwen 2 MoE's sliding_window 0, Cohere 2 MoE's null
    rms_norm_eps did)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    refused, checked = {}, 0
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            config = json.loads(transformers.AutoConfig.for_model(model_type).to_json_string())
        except Exception:  # a type whose config class this transformers cannot build alone (a composite)
            continue
        checked += 1
        try:
            check_values(config)
        except TorchpreError as error:
            refused[model_type] = str(error)
    assert checked > len(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) // 2, checked  # 199 of 200 with transformers 5.25
    assert refused == {}


def shard_folder(folder: Path, manifest_vocab: int, token: int) -> Path:
    """A shard folder whose manifest says `manifest_vocab` ids (its largest id unrecorded) over a file holding
    `token` at offset 3."""
    folder.mkdir()
    info = write_shard(folder, "part-0", [[1, 2, 3, token, 5, 6, 7, 8, 9, 10]], TOKENIZER.vocab_size)
    info = type(info)(info.name, info.num_tokens, info.num_documents, None)
    Manifest(DEFAULT_TOKENIZER_PATH.name, SHA256, manifest_vocab, [info]).write(folder)
    return folder


def test_a_manifest_claiming_more_ids_than_the_embedding_has_rows_is_refused(tmp_path):
    folder = shard_folder(tmp_path / "shards", manifest_vocab=4096, token=3000)
    with pytest.raises(TorchpreError, match="vocab_size = 4,096, more ids than the 2,048 rows of the model's"):
        ShardWindows(str(folder), 4, SHA256, vocab_size=2048)
    windows = ShardWindows(str(folder), 4, SHA256, vocab_size=4096)  # a model with 4,096 rows holds id 3,000
    assert windows[0][0].tolist() == [1, 2, 3, 3000]


def test_each_window_is_checked_against_the_models_rows(tmp_path):
    """The manifest's vocabulary is within the model's; the file holds an id past the model's rows."""
    folder = shard_folder(tmp_path / "shards", manifest_vocab=2048, token=2500)
    windows = ShardWindows(str(folder), 4, SHA256, vocab_size=2048)
    with pytest.raises(TorchpreError, match="at token offset 3 holds token id 2,500, but the model's embedding has"):
        windows[0]


def test_a_json_lines_record_is_bounded_before_it_is_kept(monkeypatch):
    monkeypatch.setitem(json_input.LIMITS, "line", 8)
    lines = b'[1, 23]\n\n"12345"\n[1,2,3,4]\n'  # 7, 0, 7 and 9 bytes before the newline
    with pytest.raises(UntrustedInput, match=r"x.jsonl \(line 4\) holds more than 8 bytes"):
        for number, value in json_input.json_lines(io.BytesIO(lines), Path("x.jsonl")):
            assert (number, value) in ((1, [1, 23]), (3, "12345"))
    assert [*json_input.json_lines(io.BytesIO(b"[1,2,34]"), Path("x.jsonl"))] == [(1, [1, 2, 34])]  # 8: no newline


def _hub_cache(tmp_path: Path, files: dict[str, bytes]) -> Path:
    """A huggingface_hub cache of one repository: each file a blob named by its SHA-256, and the snapshot folder of
    links `../../blobs/<hash>` (one `../` more per subfolder) that `hf download` without --local-dir leaves."""
    import hashlib

    repo = tmp_path / "models--org--name"
    snapshot = repo / "snapshots" / ("0" * 40)
    (repo / "blobs").mkdir(parents=True)
    for name, data in files.items():
        blob = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).symlink_to("../" * (name.count("/") + 2) + f"blobs/{blob}")
    return snapshot


def test_a_hub_cache_snapshot_reads_its_blobs_and_no_other_link(tmp_path):
    """A folder as huggingface_hub caches it is read through its links into its own blobs, and only those: a link of
    another form, or a blob that is itself a link, is refused by name."""
    save_file({"w": torch.full((2, 2), 3.0)}, tmp_path / "weights.safetensors")
    files = {"config.json": b"{}", "model.safetensors": (tmp_path / "weights.safetensors").read_bytes()}
    snapshot = _hub_cache(tmp_path, files)
    weights = HFFolder(snapshot)
    with weights.reading():
        assert weights.read("w", ()).tolist() == [[3.0, 3.0], [3.0, 3.0]]
    (tmp_path / "elsewhere.safetensors").write_bytes(files["model.safetensors"])
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(UntrustedInput, match="model.safetensors is, or leads through, a symbolic link"):
        HFFolder(snapshot)
    (snapshot / "model.safetensors").unlink()
    blob = snapshot.parent.parent / "blobs" / ("f" * 64)
    blob.symlink_to(tmp_path / "elsewhere.safetensors")
    (snapshot / "model.safetensors").symlink_to(f"../../blobs/{'f' * 64}")
    with pytest.raises(UntrustedInput, match=f"blobs/{'f' * 64} is, or leads through, a symbolic link"):
        HFFolder(snapshot)
